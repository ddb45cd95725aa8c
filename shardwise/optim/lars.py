"""LARS (You et al., 2017, "Large Batch Training of Convolutional Networks"): SGD with
momentum whose step is scaled per layer by a trust ratio (C16).

For each parameter w with gradient g, with weight decay λ and trust coefficient η:

    trust = η ||w|| / (||g|| + λ ||w|| + eps)      (1 when ||w|| or ||g|| is 0)
    d     = trust · (g + λ w)
    buf   = d at the first step, then momentum · buf + (1 − dampening) · d
    w    <- w − lr · (d + momentum · buf if nesterov else buf)

which is the form timm's `Lars` and the SimCLR / BYOL implementations take: the trust
ratio multiplies the decayed gradient before it enters the momentum buffer, so lr is a
global scale and each layer's step is about η · lr of its own norm.

`exclude_vectors` (default True): parameters with fewer than 2 dimensions (biases,
normalisation gains) take trust 1, i.e. plain SGD with momentum and their group's weight
decay; adapting them destabilises training (You et al. adapt every layer; timm, SimCLR,
BYOL and VISSL exclude them). Set it False for the paper's rule.

Under ZeRO the two norms are of whole parameters: the pieces' squared norms are summed
over the shard group in one small reduction (optim/sharded.py).
"""

from __future__ import annotations

from typing import Iterable

import torch

from shardwise.optim.layout import params_with_grad
from shardwise.optim.sharded import ShardAwareOptimizer


class Lars(ShardAwareOptimizer):
    def __init__(
        self,
        params: Iterable,
        lr: float = 1.0,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        trust_coefficient: float = 0.001,
        eps: float = 1e-8,
        exclude_vectors: bool = True,
    ):
        if min(lr, momentum, weight_decay, trust_coefficient, eps) < 0:
            raise ValueError(f"lr {lr}, momentum {momentum}, weight_decay {weight_decay}, trust_coefficient "
                             f"{trust_coefficient} and eps {eps} must not be negative")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError(f"nesterov needs momentum > 0 and dampening 0, got {momentum} and {dampening}")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
                        trust_coefficient=trust_coefficient, eps=eps, exclude_vectors=exclude_vectors)
        super().__init__(params, defaults)
        self.last_trust_ratios: torch.Tensor | None = None  # per parameter, for logging

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        trained = list(params_with_grad(self))
        norms = self.parameter_norms([(p, p) for p, _ in trained], [(p, p.grad) for p, _ in trained]).cpu()
        self.last_trust_ratios = torch.ones(self.parameter_count, dtype=torch.float64)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            ratios = []
            for param in params:
                shard = self.shard_of(param)
                ratio = 1.0
                if not (group["exclude_vectors"] and len(shard.shape) < 2):
                    ratio = _trust_ratio(norms[shard.index, 0].item(), norms[shard.index, 1].item(), group)
                self.last_trust_ratios[shard.index] = ratio
                ratios.append(ratio)
            directions = torch._foreach_add([p.grad for p in params], params, alpha=group["weight_decay"])
            torch._foreach_mul_(directions, ratios)
            if group["momentum"] > 0:
                directions = self._momentum(params, directions, group)
            torch._foreach_add_(params, directions, alpha=-group["lr"])
        return loss

    def _momentum(self, params: list[torch.Tensor], directions: list[torch.Tensor], group: dict) -> list[torch.Tensor]:
        """torch.optim.SGD's momentum: the buffer starts as the first direction."""
        buffers = []
        for param, direction in zip(params, directions):
            state = self.state[param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = direction.clone()
            else:
                state["momentum_buffer"].mul_(group["momentum"]).add_(direction, alpha=1 - group["dampening"])
            buffers.append(state["momentum_buffer"])
        if group["nesterov"]:
            torch._foreach_add_(directions, buffers, alpha=group["momentum"])
            return directions
        return buffers


def _trust_ratio(weight_norm: float, grad_norm: float, group: dict) -> float:
    if weight_norm == 0 or grad_norm == 0:
        return 1.0
    return group["trust_coefficient"] * weight_norm / (grad_norm + group["weight_decay"] * weight_norm + group["eps"])
