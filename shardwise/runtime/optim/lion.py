"""Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms"), as DeepSpeed
0.19.8 computes it (its config type "Lion": `FusedLion` on the GPU, `DeepSpeedCPULion`
with the optimizer offloaded).

For each element, with gradient g, momentum m (zero at the start), betas (b1, b2),
learning rate lr and weight decay wd:

    c = b1 m + (1 - b1) g                 the interpolation whose sign is the step
    w <- w (1 - lr wd) - lr sign(c)       weight decay decoupled, as in AdamW
    m <- b2 m + (1 - b2) g

Where c is exactly zero the two DeepSpeed kernels disagree: the CPU op takes the sign of
the zero (`-copysign(lr, c)`: +0 steps down by lr, -0 up), the CUDA kernel steps up by lr
for either (`c > 0 ? -lr : lr`). `step_up_at_zero` picks the CUDA kernel's rule
(`deepspeed.ops.lion.FusedLion`); the default is the CPU op's, which the config's "Lion"
builds (checked against DeepSpeed's own CPU op in tests/runtime/optim/test_lion.py).

One fp32 state tensor per element (K = 4 bytes, plus the master copy in 16-bit training):
DeepSpeed's CPU op also allocates an `exp_avg_sq` it never reads, which this does not.
Every operation is element-wise, so the optimizer runs unchanged on ZeRO's flat pieces.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Iterable

import torch

from shardwise.runtime.optim.closure import closure_loss
from shardwise.runtime.optim.params import check_betas, param
from shardwise.runtime.optim.registry import OptimizerSpec, register_optimizer


CHUNK = 1 << 16  # elements per chunk of the update (see `_update`)
SIGN_BIT = -(1 << 31)  # an fp32's sign bit, as an int32


class Lion(torch.optim.Optimizer):
    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 weight_decay: float = 0.0, *, step_up_at_zero: bool = False):
        if lr < 0 or weight_decay < 0:
            raise ValueError(f"Lion: lr {lr} and weight_decay {weight_decay} must not be negative")
        check_betas(tuple(betas))
        defaults = dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay, step_up_at_zero=step_up_at_zero)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        for group in self.param_groups:
            lr, (beta1, beta2), decay = group["lr"], group["betas"], group["weight_decay"]
            weights = [weight for weight in group["params"] if weight.grad is not None]
            if not weights:
                continue
            if any(weight.grad.is_sparse for weight in weights):
                raise RuntimeError("Lion does not take sparse gradients (neither does DeepSpeed's)")
            for weight in weights:
                if not self.state[weight]:
                    self.state[weight]["exp_avg"] = torch.zeros_like(weight, memory_format=torch.preserve_format)
                _update(weight, self.state[weight]["exp_avg"], weight.grad, lr=lr, beta1=beta1, beta2=beta2,
                        decay=decay, step_up_at_zero=group["step_up_at_zero"])
        return loss


def _update(weight: torch.Tensor, momentum: torch.Tensor, grad: torch.Tensor, *, lr: float, beta1: float,
            beta2: float, decay: float, step_up_at_zero: bool) -> None:
    """One element-wise Lion step, a cache-sized chunk at a time: the interpolation and the
    signed step are temporaries, and a whole tensor's would cost more in fresh memory than
    the arithmetic does."""
    if not (weight.is_contiguous() and momentum.is_contiguous() and grad.is_contiguous()):
        weight_flat, momentum_flat, grad_flat = weight.reshape(-1), momentum.reshape(-1), grad.reshape(-1)
        _update(weight_flat, momentum_flat, grad_flat, lr=lr, beta1=beta1, beta2=beta2, decay=decay,
                step_up_at_zero=step_up_at_zero)
        weight.copy_(weight_flat.view_as(weight))
        momentum.copy_(momentum_flat.view_as(momentum))
        return
    weight, momentum, grad = weight.view(-1), momentum.view(-1), grad.view(-1)
    for start in range(0, weight.numel(), CHUNK):
        piece, moment, slope = (tensor[start:start + CHUNK] for tensor in (weight, momentum, grad))
        interpolation = moment.mul(beta1).add_(slope, alpha=1 - beta1)
        if step_up_at_zero:  # the CUDA kernel: +0 steps up like -0
            interpolation.masked_fill_(interpolation == 0, -0.0)
        if decay > 0:
            piece.mul_(1 - lr * decay)
        piece.sub_(_signed(lr, interpolation))
        moment.mul_(beta2).add_(slope, alpha=1 - beta2)


def _signed(value: float, like: torch.Tensor) -> torch.Tensor:
    """copysign(value, like), written into `like`: for fp32 by setting the sign bit on
    value's bits (torch's copysign and where run far slower on the CPU)."""
    if like.dtype != torch.float32:
        return torch.copysign(torch.full_like(like, value), like)
    value_bits = struct.unpack("<i", struct.pack("<f", value))[0]
    return like.view(torch.int32).bitwise_and_(SIGN_BIT).bitwise_or_(value_bits).view(torch.float32)


@dataclass(frozen=True)
class LionParams:
    """DeepSpeed's "Lion" (FusedLion / DeepSpeedCPULion): their arguments and defaults."""

    lr: float = param(1e-3, ge=0)
    betas: tuple[float, float] = param((0.9, 0.999), check=check_betas)
    weight_decay: float = param(0.0, ge=0)


def _build(groups: list[dict], params: dict) -> Lion:
    return Lion(groups, **{key: tuple(value) if key == "betas" else value for key, value in params.items()})


def _main_job_params(adamw: dict, steps: int) -> dict:
    """Chen et al.'s advice for Lion in place of AdamW: a 3x smaller learning rate and a 3x
    larger weight decay (its steps are all of size lr), their language-model betas."""
    return {"lr": adamw["lr"] / 3, "betas": (0.95, 0.98), "weight_decay": 3 * adamw.get("weight_decay", 0.0)}


register_optimizer(OptimizerSpec("Lion", LionParams, _build, fp32_states=lambda params: 1,  # K: the momentum
                                 main_job_params=_main_job_params))
