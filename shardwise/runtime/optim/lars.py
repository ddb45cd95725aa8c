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

Speed: multi-tensor (foreach) kernels by default; `compile=True` (optim/compiled.py)
makes the step after the norms one compiled loop per tensor (decay, trust ratio,
momentum and weight update in one pass), once the momentum buffers exist.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from shardwise.runtime.optim.closure import closure_loss
from shardwise.runtime.optim import native
from shardwise.runtime.optim.compiled import kernel
from shardwise.runtime.optim.layout import params_with_grad
from shardwise.runtime.optim.params import check_nesterov, param
from shardwise.runtime.optim.registry import OptimizerSpec, register_optimizer
from shardwise.runtime.optim.sharded import ShardAwareOptimizer


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
        compile: bool = False,
    ):
        if min(lr, momentum, weight_decay, trust_coefficient, eps) < 0:
            raise ValueError(f"lr {lr}, momentum {momentum}, weight_decay {weight_decay}, trust_coefficient "
                             f"{trust_coefficient} and eps {eps} must not be negative")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError(f"nesterov needs momentum > 0 and dampening 0, got {momentum} and {dampening}")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
                        trust_coefficient=trust_coefficient, eps=eps, exclude_vectors=exclude_vectors, compile=compile)
        super().__init__(params, defaults)
        self.last_trust_ratios: torch.Tensor | None = None  # per parameter, for logging

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        trained = list(params_with_grad(self))
        native_step = native.enabled() and all(_native_takes(p, self.state[p]) for p, _ in trained)
        if native_step:  # both squared norms in one pass (optim/native.py)
            squares = torch.zeros(len(trained), 2, dtype=torch.float64)
            for row, (param, _) in zip(squares, trained):
                native.library().two_squares(param.data_ptr(), param.grad.data_ptr(), param.numel(), row.data_ptr(),
                                             native.threads())
            norms = self.parameter_norms_of_squares([p for p, _ in trained], squares).cpu()
        else:
            norms = self.parameter_norms([(p, p) for p, _ in trained], [(p, p.grad) for p, _ in trained]).cpu()
        self.last_trust_ratios = torch.ones(self.parameter_count, dtype=torch.float64)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            ratios = self._trust_ratios(params, norms, group)
            if native_step:
                self._native_step(params, ratios, group)
                continue
            started = all("momentum_buffer" in self.state[p] for p in params)
            if group.get("compile", False) and (started or group["momentum"] == 0):  # optim/compiled.py
                self._compiled_step(params, ratios, group)
                continue
            directions = torch._foreach_add([p.grad for p in params], params, alpha=group["weight_decay"])
            torch._foreach_mul_(directions, ratios)
            if group["momentum"] > 0:
                directions = self._momentum(params, directions, group)
            torch._foreach_add_(params, directions, alpha=-group["lr"])
        return loss

    def _trust_ratios(self, params: list[torch.Tensor], norms: torch.Tensor, group: dict) -> list[float]:
        """Per parameter: its trust ratio (1 for vectors when they are excluded), also
        recorded in `last_trust_ratios`."""
        index = torch.tensor([self.shard_of(p).index for p in params])
        weight_norm, grad_norm = norms[index, 0], norms[index, 1]
        decay, eps = group["weight_decay"], group["eps"]
        ratios = group["trust_coefficient"] * weight_norm / (grad_norm + decay * weight_norm + eps)
        adapted = (weight_norm != 0) & (grad_norm != 0)
        if group["exclude_vectors"]:
            adapted &= torch.tensor([len(self.shard_of(p).shape) >= 2 for p in params])
        ratios = torch.where(adapted, ratios, 1.0)
        self.last_trust_ratios[index] = ratios
        return ratios.tolist()

    def _momentum(self, params: list[torch.Tensor], directions: list[torch.Tensor], group: dict) -> list[torch.Tensor]:
        """torch.optim.SGD's momentum: the buffer starts as the first direction."""
        buffers = []
        for param, direction in zip(params, directions):
            state = self.state[param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = direction.clone()
                buffers.append(None)
            else:
                buffers.append(state["momentum_buffer"])
        started = [(b, d) for b, d in zip(buffers, directions) if b is not None]
        if started:
            torch._foreach_mul_([b for b, _ in started], group["momentum"])
            torch._foreach_add_([b for b, _ in started], [d for _, d in started], alpha=1 - group["dampening"])
        buffers = [self.state[param]["momentum_buffer"] for param in params]
        if group["nesterov"]:
            torch._foreach_add_(directions, buffers, alpha=group["momentum"])
            return directions
        return buffers

    def _native_step(self, params: list[torch.Tensor], ratios: list[float], group: dict) -> None:
        """The same step, one pass per tensor in the native kernel (optim/native.py)."""
        momentum = group["momentum"]
        for param, ratio in zip(params, ratios):
            state = self.state[param]
            started = "momentum_buffer" in state
            if momentum > 0 and not started:
                state["momentum_buffer"] = torch.empty_like(param)
            buffer = state["momentum_buffer"].data_ptr() if momentum > 0 else None
            native.library().lars_apply(
                param.data_ptr(), param.grad.data_ptr(), buffer, param.numel(), group["weight_decay"], ratio,
                momentum, 1 - group["dampening"], group["nesterov"], started, group["lr"], native.threads())

    def _compiled_step(self, params: list[torch.Tensor], ratios: list[float], group: dict) -> None:
        """The same step, one compiled loop per tensor (momentum buffers already exist)."""
        step = _momentum_step if group["momentum"] > 0 else _plain_step
        lr = torch.tensor(group["lr"], dtype=torch.float64)
        constants = {key: group[key] for key in ("weight_decay", "momentum", "dampening", "nesterov")}
        for param, ratio in zip(params, ratios):
            buffer = self.state[param].get("momentum_buffer", param)  # unused without momentum
            ratio = torch.tensor(ratio, dtype=torch.float64)
            # detached: Dynamo would compile for each nn.Parameter's shape
            kernel(step, True, param)(param.detach(), param.grad, buffer, ratio, lr, **constants)


def _native_takes(param: torch.Tensor, state: dict) -> bool:
    """Whether the native kernel can step this parameter: fp32 CPU tensors, contiguous."""
    buffer = state.get("momentum_buffer")
    tensors = (param, param.grad) if buffer is None else (param, param.grad, buffer)
    return all(t.dtype == torch.float32 for t in tensors) and native.takes(*tensors)


def _momentum_step(param: torch.Tensor, grad: torch.Tensor, buffer: torch.Tensor, ratio: torch.Tensor,
                   lr: torch.Tensor, *, weight_decay: float, momentum: float, dampening: float, nesterov: bool) -> None:
    """`Lars.step`'s arithmetic for one tensor whose momentum buffer exists (compiled)."""
    direction = (grad + weight_decay * param) * ratio
    buffer.mul_(momentum).add_(direction, alpha=1 - dampening)
    param.sub_((direction + momentum * buffer if nesterov else buffer) * lr)


def _plain_step(param: torch.Tensor, grad: torch.Tensor, buffer: torch.Tensor, ratio: torch.Tensor,
                lr: torch.Tensor, *, weight_decay: float, momentum: float, dampening: float, nesterov: bool) -> None:
    """`Lars.step`'s arithmetic for one tensor without momentum (compiled)."""
    param.sub_((grad + weight_decay * param) * ratio * lr)


@dataclass(frozen=True)
class LarsParams:
    """LARS with timm's `Lars` defaults."""

    lr: float = param(1.0, ge=0)
    momentum: float = param(0.0, ge=0)
    dampening: float = 0.0
    weight_decay: float = param(0.0, ge=0)
    nesterov: bool = False
    trust_coefficient: float = param(0.001, ge=0)
    eps: float = param(1e-8, ge=0)
    exclude_vectors: bool = param(
        True, description="parameters with fewer than 2 dimensions (biases, norms) take trust ratio 1")
    compile: bool = param(False, description="torch.compile the step's per-tensor loops (optim/compiled.py)")

    def __post_init__(self) -> None:
        check_nesterov(self.nesterov, self.momentum, self.dampening)


# K: SGD's momentum buffer, when momentum is on.
register_optimizer(OptimizerSpec(
    "Lars", LarsParams, lambda groups, params: Lars(groups, **params),
    fp32_states=lambda params: int(params.get("momentum", 0) > 0), per_parameter=True,
    main_job_params=lambda adamw, steps: {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-4,
                                          "trust_coefficient": 0.02},
))
