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
"""

from __future__ import annotations

import math
from typing import Iterable

import torch

from shardwise.optim.sharded import ShardAwareOptimizer


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
    ):
        if not 0.0 <= min_coeff <= max_coeff:
            raise ValueError(f"need 0 <= min_coeff <= max_coeff, got {min_coeff} and {max_coeff}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, eps_inside_sqrt=eps_inside_sqrt,
                        max_coeff=max_coeff, min_coeff=min_coeff)
        super().__init__(params, defaults)
        self.last_trust_ratios: torch.Tensor | None = None  # per parameter, for logging

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        updates: list[tuple[torch.Tensor, torch.Tensor, dict]] = []
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(param)
                    state["exp_avg_sq"] = torch.zeros_like(param)
                state["step"] += 1
                grad = param.grad
                state["exp_avg"].lerp_(grad, 1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                if group["eps_inside_sqrt"]:
                    denominator = (state["exp_avg_sq"] + group["eps"]).sqrt_()
                else:
                    denominator = state["exp_avg_sq"].sqrt().add_(group["eps"])
                update = state["exp_avg"] / denominator
                if group["weight_decay"]:
                    update.add_(param, alpha=group["weight_decay"])
                updates.append((param, update, group))
        norms = self.parameter_norms([(p, p) for p, _, _ in updates], [(p, u) for p, u, _ in updates]).cpu()
        self.last_trust_ratios = torch.ones(self.parameter_count, dtype=torch.float64)
        for param, update, group in updates:
            index = self.shard_of(param).index
            weight_norm, update_norm = norms[index, 0].item(), norms[index, 1].item()
            ratio = 1.0
            if weight_norm > 0 and update_norm > 0:
                ratio = min(max(weight_norm / update_norm, group["min_coeff"]), group["max_coeff"])
            self.last_trust_ratios[index] = ratio
            param.add_(update, alpha=-_step_size(group, self.state[param]["step"]) * ratio)
        return loss


def _step_size(group: dict, step: torch.Tensor) -> float:
    if not group["bias_correction"]:
        return group["lr"]
    beta1, beta2 = group["betas"]
    t = step.item()
    return group["lr"] * math.sqrt(1 - beta2**t) / (1 - beta1**t)
