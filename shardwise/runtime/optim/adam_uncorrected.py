"""Adam without bias correction: DeepSpeed's Adam with `bias_correction: false`.

BERT-era configs (Bing BERT, Megatron's BERT recipes in DeepSpeedExamples) turn bias
correction off, and DeepSpeed's Adam kernels honour it (csrc/adam/multi_tensor_adam.cu and
cpu_adam_impl.cpp: both correction factors become 1), so the first steps move the weights
by lr·m/(√v + eps) with the raw, still-small moments instead of lr·m̂/(√v̂ + eps) with
corrected ones. torch's Adam has no such switch, hence this class. Per step and element,
as DeepSpeed's kernel computes it:

    L2 mode (adam_w_mode false)   g ← g + weight_decay·p
    m ← β1·m + (1 − β1)·g
    v ← β2·v + (1 − β2)·g²
    AdamW mode                    p ← p − lr·(m / (√v + eps) + weight_decay·p)
    L2 mode                       p ← p − lr·m / (√v + eps)

The state is torch's (`exp_avg`, `exp_avg_sq`, `step`), so checkpoints and ZeRO's
partitioned state treat it as they treat torch's Adam.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from shardwise.runtime.optim.closure import closure_loss


class UncorrectedAdam(torch.optim.Optimizer):
    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, *, adam_w_mode: bool = True):
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                                  "adam_w_mode": adam_w_mode})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = closure_loss(closure)
        for group in self.param_groups:
            params = [param for param in group["params"] if param.grad is not None]
            if not params:
                continue
            beta1, beta2 = group["betas"]
            lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
            grads = [param.grad for param in params]
            states = [self._state(param) for param in params]
            if decay and not group["adam_w_mode"]:
                grads = torch._foreach_add(grads, params, alpha=decay)
            means = [state["exp_avg"] for state in states]
            squares = [state["exp_avg_sq"] for state in states]
            torch._foreach_mul_(means, beta1)
            torch._foreach_add_(means, grads, alpha=1 - beta1)
            torch._foreach_mul_(squares, beta2)
            torch._foreach_addcmul_(squares, grads, grads, value=1 - beta2)
            if decay and group["adam_w_mode"]:
                torch._foreach_mul_(params, 1 - lr * decay)
            denominators = torch._foreach_add(torch._foreach_sqrt(squares), eps)
            torch._foreach_addcdiv_(params, means, denominators, value=-lr)
            for state in states:
                state["step"] += 1
        return loss

    def _state(self, param: torch.Tensor) -> dict[str, Any]:
        state = self.state[param]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state
