"""1-bit Adam (Tang et al., 2021, "1-bit Adam: Communication Efficient Large-Scale Training
with Adam's Convergence Speed"), with DeepSpeed's `OneBitAdam` parameters (C18).

Steps 1 .. freeze_step (the warm-up), on the gradient g ZeRO averaged over the ranks
(all-reduced at stage 0, reduce-scattered to each partition's owner at stages 1-2):

    m <- β1·m + (1 − β1)·g          v <- β2·v + (1 − β2)·g²

Later steps, on each rank's own gradient g_i, with v frozen (optim/onebit.py; at stages
1-2 each rank then updates the masters of its own partition, whose momentum it served):

    m <- compressed average over ranks of (β1·m + (1 − β1)·g_i)

Every step: w <- w − step_size · (m / (√v + eps) + weight_decay · w), eps inside the square
root if `eps_inside_sqrt`; weight decay decoupled, as DeepSpeed's. step_size is lr, times
√(1 − β2^t_v) / (1 − β1^t) with `bias_correction` (t_v = min(t, freeze_step): the
variance stops aging when it freezes). DeepSpeed accepts `bias_correction` and never
applies it; give `bias_correction: false` for its arithmetic (the paper's update rule).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Literal

import torch

from shardwise.formulas.memory import onebit_state_terms
from shardwise.runtime.optim.closure import closure_loss
from shardwise.runtime.optim import native
from shardwise.runtime.optim.onebit import ZERO_STAGES, OneBitCodec, OneBitOptimizer, main_job_params, native_takes
from shardwise.runtime.optim.onebit_exchange import AdamUpdates, GatheredSigns
from shardwise.runtime.optim.params import check_betas, param
from shardwise.runtime.optim.registry import OptimizerSpec, register_optimizer


class OneBitAdam(OneBitOptimizer):
    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        freeze_step: int = 100000,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        amsgrad: bool = False,
        cuda_aware: bool = False,
        comm_backend_name: str = "nccl",
    ):
        refuse_unsupported(amsgrad, max_grad_norm)
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        eps_inside_sqrt=eps_inside_sqrt, weight_decay=weight_decay, max_grad_norm=max_grad_norm,
                        amsgrad=amsgrad)
        super().__init__(params, defaults, freeze_step, cuda_aware, comm_backend_name)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        step = self._advance()
        frozen, updated = step > self.freeze_step, False
        if frozen:
            gathered = self.fold_and_exchange_signs()  # stage 0 on the kernels: decoded in the update's pass
            updated = gathered is not None and self._decode_and_update(gathered, step)
        else:
            warm_up_moments(self)
        if not updated:
            self._update(step, frozen)
        self._finish_step(step)
        return loss

    def _update(self, step: int, frozen: bool) -> None:
        for group in self.param_groups:
            step_size = adam_step_size(group, step, self.freeze_step)
            for param in group["params"]:
                if param.grad is None and not frozen:
                    continue
                exp_avg, exp_avg_sq = self.state[param]["exp_avg"], self.state[param]["exp_avg_sq"]
                if native_takes(param, exp_avg, exp_avg_sq):  # the update in one pass (optim/native.py)
                    native.library().lamb_apply(param.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
                                                param.numel(), -step_size, group["eps"], group["weight_decay"],
                                                group["eps_inside_sqrt"], native.threads())
                    continue
                update = adam_update_(exp_avg, group, exp_avg_sq)
                if group["weight_decay"]:
                    update.add_(param, alpha=group["weight_decay"])
                param.add_(update, alpha=-step_size)

    def _decode_and_update(self, gathered: GatheredSigns, step: int) -> bool:
        """Every tensor's update in the pass that decodes its averaged momentum (optim/
        onebit_exchange.py), and the padding decoded; False where the kernels
        cannot take a tensor (the momentum then decoded alone)."""
        layout = self.momentum_layout()
        variances = [state["exp_avg_sq"] for _, _, _, state in layout]
        if not native_takes(*(param for param, _, _, _ in layout), *variances):
            gathered.decode_(self.momentum_flat(), 0)
            return False
        sizes = {id(group): adam_step_size(group, step, self.freeze_step) for group in self.param_groups}
        gathered.decode_adam_update_(self.momentum_flat(), AdamUpdates.of([
            (start, variance, param, -sizes[id(group)], group["eps"], group["weight_decay"], group["eps_inside_sqrt"])
            for (param, group, start, _), variance in zip(layout, variances)]))
        self.decode_untrained_(gathered)
        self.remember_momentum_signs(gathered)  # the next step's worker pass reads the momentum from them
        return True


def warm_up_moments(optimizer: OneBitOptimizer) -> None:
    """Adam's moments from the (all-reduced) gradient, for parameters that have one."""
    for group in optimizer.param_groups:
        beta1, beta2 = group["betas"]
        for param in group["params"]:
            if param.grad is None:
                continue
            state = optimizer.state[param]
            state["exp_avg"].mul_(beta1).add_(param.grad, alpha=1 - beta1)
            state["exp_avg_sq"].mul_(beta2).addcmul_(param.grad, param.grad, value=1 - beta2)


def variance_denominator(group: dict, exp_avg_sq: torch.Tensor) -> torch.Tensor:
    if group["eps_inside_sqrt"]:
        return (exp_avg_sq + group["eps"]).sqrt_()
    return exp_avg_sq.sqrt().add_(group["eps"])


def adam_update_(exp_avg: torch.Tensor, group: dict, exp_avg_sq: torch.Tensor) -> torch.Tensor:
    """m / (√v + eps) in one new tensor (the denominator's, divided into in place)."""
    denominator = variance_denominator(group, exp_avg_sq)
    return torch.div(exp_avg, denominator, out=denominator)


def adam_step_size(group: dict, step: int, freeze_step: int) -> float:
    if not group["bias_correction"]:
        return group["lr"]
    beta1, beta2 = group["betas"]
    return group["lr"] * math.sqrt(1 - beta2 ** min(step, freeze_step)) / (1 - beta1**step)


def refuse_unsupported(amsgrad: bool, max_grad_norm: float) -> None:
    if amsgrad:
        raise ValueError("amsgrad true: 1-bit Adam/LAMB have no AMSGrad variant (DeepSpeed refuses it too)")
    if max_grad_norm:
        raise ValueError(f"max_grad_norm {max_grad_norm}: clip with the config's gradient_clipping instead "
                         "(DeepSpeed's 1-bit optimizers ignore max_grad_norm)")


def _no_amsgrad(enabled: bool) -> bool:
    if enabled:
        raise ValueError("amsgrad true: 1-bit Adam/LAMB have no AMSGrad variant (DeepSpeed refuses it too)")
    return enabled


def _clip_elsewhere(norm: float) -> float:
    if norm:
        raise ValueError(f"max_grad_norm {norm}: DeepSpeed's 1-bit optimizers ignore it; clip with the "
                         "top-level gradient_clipping instead")
    return norm


@dataclass(frozen=True)
class OneBitAdamParams:
    """1-bit Adam with DeepSpeed's `OneBitAdam` parameters and defaults. `bias_correction`
    is applied (DeepSpeed accepts it and never does: give false for its arithmetic);
    `cuda_aware` and `comm_backend_name` choose DeepSpeed's transport and are accepted
    without effect: the exchange runs on the data-parallel group's backend."""

    lr: float = param(1e-3, ge=0)
    freeze_step: int = param(100000, ge=1, description="warm-up steps with full-precision gradients, after "
                             "which the variance is frozen and the momentum exchanged at 1 bit per element")
    bias_correction: bool = True
    betas: tuple[float, float] = param((0.9, 0.999), check=check_betas)
    eps: float = param(1e-8, gt=0)
    eps_inside_sqrt: bool = False
    weight_decay: float = param(0.0, ge=0)
    max_grad_norm: float = param(0.0, check=_clip_elsewhere, description="accepted as 0 only: clip with "
                                 "gradient_clipping")
    amsgrad: bool = param(False, check=_no_amsgrad)
    cuda_aware: bool = False
    comm_backend_name: Literal["nccl", "gloo", "mpi", "hccl", "compressed"] = "nccl"


# K after the warm-up: momentum, variance and the worker's error-feedback buffer per element;
# the server's error (1/N of the elements) and the momentum buffer's padding are counted
# through the optimizer (shardwise/formulas/memory.py `onebit_state_bytes`).
register_optimizer(OptimizerSpec(
    "OneBitAdam", OneBitAdamParams, lambda groups, params: OneBitAdam(groups, **params),
    fp32_states=lambda params: 3, codec=OneBitCodec(), per_parameter=True, zero_stages=ZERO_STAGES, offload=False,
    state_terms=lambda stage, dtype, grad_dtype=None: onebit_state_terms(stage, dtype, grad_dtype=grad_dtype), main_job_params=main_job_params,
))
