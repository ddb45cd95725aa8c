"""LAMB (You et al., 2019, "Large Batch Optimization for Deep Learning"), with DeepSpeed's
`Lamb` / `FusedLamb` knobs (C16).

Adam's update, then scaled per parameter by a trust ratio ||w|| / ||update|| clamped to
[min_coeff, max_coeff], so every layer moves by about the same fraction of its own norm
whatever its gradient scale: what lets batch sizes grow to tens of thousands.

As DeepSpeed's kernel does: the bias corrections go into the step size
(lr · sqrt(1 − β2^t) / (1 − β1^t)), eps is added outside the square root unless
`eps_inside_sqrt`, decoupled weight decay is part of the update whose norm the ratio uses,
and the ratio is 1 when either norm is zero. Under ZeRO the two norms are of whole
parameters: each rank adds up its pieces and one small all-reduce over the shard group
completes them (optim/sharded.py).

Speed: fp32 tensors on the CPU step in two native passes (optim/native.py), on a GPU in
the same two passes as Triton kernels (optim/triton_kernels.py). Otherwise each operation
is one multi-tensor (foreach) kernel over a param group, about ten passes over memory per
step. `compile=True` (optim/compiled.py) runs two
compiled loops per tensor instead: moments and both squared norms in one pass, then the
weight update (recomputed, not stored) in a second; measured 3-4x torch's fused AdamW per
element against 8-12x eager (BENCHMARKS.md), the norms being the reduction in between.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import torch

from shardwise.runtime.optim.closure import closure_loss
from shardwise.runtime.optim import native, triton_gate
from shardwise.runtime.optim.compiled import kernel
from shardwise.runtime.optim.params import check_betas, param
from shardwise.runtime.optim.registry import OptimizerSpec, register_optimizer
from shardwise.runtime.optim.sharded import ShardAwareOptimizer, piece_squares

# `shardwise train --optimizer lamb`'s rate: LAMB's step is lr x ||w|| per layer rather
# than lr per element, so AdamW's rate would barely move the weights.
MAIN_JOB_LR = 2e-2


class Lamb(ShardAwareOptimizer):
    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        bias_correction: bool = True,
        eps_inside_sqrt: bool = False,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        compile: bool = False,
    ):
        if not 0.0 <= min_coeff <= max_coeff:
            raise ValueError(f"need 0 <= min_coeff <= max_coeff, got {min_coeff} and {max_coeff}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, eps_inside_sqrt=eps_inside_sqrt,
                        max_coeff=max_coeff, min_coeff=min_coeff, compile=compile)
        super().__init__(params, defaults)
        self.last_trust_ratios: torch.Tensor | None = None  # per parameter, for logging

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        groups = [([p for p in group["params"] if p.grad is not None], group) for group in self.param_groups]
        groups = [(params, group) for params, group in groups if params]
        for group_params, group in groups:
            self._advance(group_params, group)
        paths = [self._path(group_params, group) for group_params, group in groups]  # per group, both passes' kernels
        if getattr(self, "_sum", None) is None and all(path == "native" for path in paths):
            self._native_step_by_tensor(groups)
            return loss
        params, squares, updates = [], [], []
        for (group_params, group), path in zip(groups, paths):
            if path == "native":  # updates are recomputed when applied, not kept
                squares.append(self._native_moments_and_squares(group_params, group))
            elif path == "triton":  # the same two passes on a GPU
                beta1, beta2 = group["betas"]
                squares.append(triton_gate.kernels().lamb_moments_and_squares(
                    group_params, *self._columns(group_params, "grad", "exp_avg", "exp_avg_sq"), beta1=beta1,
                    beta2=beta2, **_constants(group)))
            elif path == "compiled":
                beta1, beta2 = group["betas"]
                squares.append(torch.stack([
                    kernel(_moments_and_squares, True, p)(*self._tensors(p), beta1=beta1, beta2=beta2,
                                                          **_constants(group))
                    for p in group_params]))
            else:
                updates.append(self._updates(group_params, group))
                squares.append(piece_squares(group_params, updates[-1]))
            params += group_params
        squares = torch.cat(squares) if squares else torch.zeros(0, 2)
        norms = self.parameter_norms_of_squares(params, squares).cpu()
        self.last_trust_ratios = torch.ones(self.parameter_count, dtype=torch.float64)
        eager_updates = iter(updates)
        for (group_params, group), path in zip(groups, paths):
            index = torch.tensor([self.shard_of(param).index for param in group_params])
            weight_norm, update_norm = norms[index, 0], norms[index, 1]
            ratios = torch.where((weight_norm > 0) & (update_norm > 0),
                                 (weight_norm / update_norm).clamp_(group["min_coeff"], group["max_coeff"]), 1.0)
            self.last_trust_ratios[index] = ratios
            steps = torch.stack([self.state[param]["step"] for param in group_params]).tolist()  # one read
            scales = [-_step_size(group, step) * ratio for step, ratio in zip(steps, ratios.tolist())]
            if path == "native":
                self._native_apply(group_params, group, scales)
                continue
            if path == "triton":
                triton_gate.kernels().lamb_apply(group_params, *self._columns(group_params, "exp_avg", "exp_avg_sq"),
                                                 scales, **_constants(group))
                continue
            if path == "compiled":
                for param, scale in zip(group_params, scales):
                    scale = torch.tensor(scale, dtype=torch.float64)
                    kernel(_apply, True, param)(*self._tensors(param), scale, **_constants(group))
                continue
            group_updates = next(eager_updates)
            torch._foreach_mul_(group_updates, scales)
            torch._foreach_add_(group_params, group_updates)
        return loss

    def _native_step_by_tensor(self, groups: list[tuple[list[torch.Tensor], dict]]) -> None:
        """Whole parameters (no ZeRO) in the native kernels: each parameter's two passes one
        after the other, its trust ratio from its own norms in between (as `step` computes
        it: the same float64 arithmetic), so the second pass finds part of its weights and
        moments in the cache the first left them in; over every parameter's first pass,
        then every second, it reads them all from memory again (5% of the step on an
        Intel Xeon core, BENCHMARKS.md)."""
        self.last_trust_ratios = torch.ones(self.parameter_count, dtype=torch.float64)
        ratios = self.last_trust_ratios.numpy()
        for group_params, group in groups:
            steps = torch.stack([self.state[param]["step"] for param in group_params]).tolist()  # one read
            squares = torch.zeros(len(group_params), 2, dtype=torch.float64)
            values = squares.numpy()
            for row, (param, step) in enumerate(zip(group_params, steps)):
                self._native_moments(param, group, squares[row])
                weight_norm, update_norm = math.sqrt(values[row, 0]), math.sqrt(values[row, 1])
                ratio = 1.0
                if weight_norm > 0 and update_norm > 0:
                    ratio = min(max(weight_norm / update_norm, group["min_coeff"]), group["max_coeff"])
                ratios[self.shard_of(param).index] = ratio
                self._native_update(param, group, -_step_size(group, step) * ratio)

    def _advance(self, params: list[torch.Tensor], group: dict) -> None:
        """State created where new, and every step count advanced (one kernel)."""
        for param in params:
            if not self.state[param]:
                self.state[param].update(step=torch.zeros((), dtype=torch.float32), exp_avg=torch.zeros_like(param),
                                         exp_avg_sq=torch.zeros_like(param))
        torch._foreach_add_([self.state[param]["step"] for param in params], 1)

    def _native_moments_and_squares(self, params: list[torch.Tensor], group: dict) -> torch.Tensor:
        """Pass 1 of the native kernels (optim/native.py): moments, and the (pieces, 2)
        squared norms of weight and update."""
        squares = torch.zeros(len(params), 2, dtype=torch.float64)
        for row, param in zip(squares, params):
            self._native_moments(param, group, row)
        return squares

    def _native_moments(self, param: torch.Tensor, group: dict, squares: torch.Tensor) -> None:
        """Pass 1 of the native kernels for one tensor: its moments, and its squared norms
        of weight and update added to `squares` (2 float64)."""
        beta1, beta2 = group["betas"]
        state = self.state[param]
        native.library().lamb_moments_and_squares(
            param.data_ptr(), param.grad.data_ptr(), state["exp_avg"].data_ptr(), state["exp_avg_sq"].data_ptr(),
            param.numel(), 1 - beta1, beta2, 1 - beta2, group["eps"], group["weight_decay"], group["eps_inside_sqrt"],
            squares.data_ptr(), native.threads())

    def _native_update(self, param: torch.Tensor, group: dict, scale: float) -> None:
        """Pass 2 of the native kernels for one tensor: w += scale · update, the update
        computed again."""
        state = self.state[param]
        native.library().lamb_apply(param.data_ptr(), state["exp_avg"].data_ptr(), state["exp_avg_sq"].data_ptr(),
                                    param.numel(), scale, group["eps"], group["weight_decay"], group["eps_inside_sqrt"],
                                    native.threads())

    def _native_apply(self, params: list[torch.Tensor], group: dict, scales: list[float]) -> None:
        """Pass 2 of the native kernels over a group's tensors."""
        for param, scale in zip(params, scales):
            self._native_update(param, group, scale)

    def _path(self, params: list[torch.Tensor], group: dict) -> str:
        """Which kernels a group's two passes take this step: "native" (CPU fp32 tensors,
        optim/native.py), "triton" (GPU fp32 tensors, optim/triton_gate.py), "compiled"
        (`compile`) or "eager" (multi-tensor torch operations)."""
        if _native(params, self.state):
            return "native"
        if all(triton_gate.takes(p, p.grad, self.state[p]["exp_avg"], self.state[p]["exp_avg_sq"]) for p in params):
            return "triton"
        return "compiled" if group.get("compile", False) else "eager"

    def _columns(self, params: list[torch.Tensor], *keys: str) -> list[list[torch.Tensor]]:
        """Per key, the group's tensors of it: the gradients (`grad`) or a state entry."""
        return [[param.grad if key == "grad" else self.state[param][key] for param in params] for key in keys]

    def _tensors(self, param: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """A kernel's tensors; the weight detached, as a plain tensor: Dynamo would compile
        for each parameter's shape (it takes nn.Parameter shapes as static)."""
        state = self.state[param]
        return param.detach(), param.grad, state["exp_avg"], state["exp_avg_sq"]

    def _updates(self, params: list[torch.Tensor], group: dict) -> list[torch.Tensor]:
        """Adam's direction m / (sqrt(v) + eps) (+ decay · w) for a group's parameters,
        its moments advanced: multi-tensor kernels, one per operation for all of them."""
        beta1, beta2 = group["betas"]
        grads = [param.grad for param in params]
        exp_avgs = [self.state[param]["exp_avg"] for param in params]
        exp_avg_sqs = [self.state[param]["exp_avg_sq"] for param in params]
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
        if group["eps_inside_sqrt"]:
            denominators = torch._foreach_add(exp_avg_sqs, group["eps"])
            torch._foreach_sqrt_(denominators)
        else:
            denominators = torch._foreach_sqrt(exp_avg_sqs)
            torch._foreach_add_(denominators, group["eps"])
        updates = torch._foreach_div(exp_avgs, denominators)
        if group["weight_decay"]:
            torch._foreach_add_(updates, params, alpha=group["weight_decay"])
        return updates


def _native(params: list[torch.Tensor], state: dict) -> bool:
    """Whether a group's step takes the native kernels: fp32 CPU tensors, all contiguous."""
    return native.enabled() and all(
        p.dtype == p.grad.dtype == torch.float32 and native.takes(p, p.grad, state[p]["exp_avg"], state[p]["exp_avg_sq"])
        for p in params)


def _constants(group: dict) -> dict[str, float | bool]:
    """The update's constants, by name, for the compiled kernels (specialised: compiled
    once per value)."""
    return {"eps": group["eps"], "weight_decay": group["weight_decay"], "eps_inside_sqrt": group["eps_inside_sqrt"]}


def _update(param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, eps: float, weight_decay: float,
            eps_inside_sqrt: bool) -> torch.Tensor:
    denominator = (exp_avg_sq + eps).sqrt() if eps_inside_sqrt else exp_avg_sq.sqrt() + eps
    update = exp_avg / denominator
    return update + weight_decay * param if weight_decay else update


def _moments_and_squares(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                         beta1: float, beta2: float, eps: float, weight_decay: float,
                         eps_inside_sqrt: bool) -> torch.Tensor:
    """Compiled kernel 1 (one pass): the moments advanced in place, and the squared norms
    of the weight and of the update, without keeping the update."""
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    update = _update(param, exp_avg, exp_avg_sq, eps, weight_decay, eps_inside_sqrt)
    return torch.stack([param.square().sum(), update.square().sum()])


def _apply(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
           scale: torch.Tensor, *, eps: float, weight_decay: float, eps_inside_sqrt: bool) -> None:
    """Compiled kernel 2 (one pass): w += scale · update, the update computed again
    (`scale`, which changes every step, a tensor so it is not compiled in)."""
    param.add_(_update(param, exp_avg, exp_avg_sq, eps, weight_decay, eps_inside_sqrt) * scale)


def _step_size(group: dict, t: float) -> float:
    if not group["bias_correction"]:
        return group["lr"]
    beta1, beta2 = group["betas"]
    return group["lr"] * math.sqrt(1 - beta2**t) / (1 - beta1**t)


def _no_amsgrad(enabled: bool) -> bool:
    if enabled:
        raise ValueError("amsgrad true is not supported by LAMB (DeepSpeed's FusedLamb refuses it too)")
    return enabled


@dataclass(frozen=True)
class LambParams:
    """LAMB with DeepSpeed's FusedLamb parameters and defaults."""

    lr: float = param(1e-3, ge=0)
    betas: tuple[float, float] = param((0.9, 0.999), check=check_betas)
    eps: float = param(1e-8, gt=0)
    weight_decay: float = param(0.0, ge=0)
    bias_correction: bool = True
    eps_inside_sqrt: bool = False
    max_coeff: float = param(10.0, ge=0)
    min_coeff: float = param(0.01, ge=0)
    amsgrad: bool = param(False, check=_no_amsgrad)
    compile: bool = param(False, description="torch.compile the step's per-tensor loops (optim/compiled.py)")

    def __post_init__(self) -> None:
        if self.min_coeff > self.max_coeff:
            raise ValueError(f"min_coeff {self.min_coeff} is above max_coeff {self.max_coeff}")


def _build(groups: list[dict], params: dict) -> Lamb:
    """`amsgrad` is a DeepSpeed key accepted only as false, not an argument of `Lamb`."""
    return Lamb(groups, **{key: value for key, value in params.items() if key != "amsgrad"})


# K: Adam's two moments.
register_optimizer(OptimizerSpec(
    "Lamb", LambParams, _build, fp32_states=lambda params: 2, per_parameter=True,
    main_job_params=lambda adamw, steps: {**adamw, "lr": MAIN_JOB_LR},
))
