"""Muon (Jordan et al., 2024, "Muon: An optimizer for hidden layers in neural networks")
for 2-D parameters, with AdamW for the others in the same optimizer, as DeepSpeed's
`MuonWithAuxAdam` does.

Matrices (torch.optim.Muon's update, operation for operation):

    B <- momentum · B + (1 − momentum) · g          (torch's lerp form)
    u = g + momentum · (B − g) if nesterov else B
    O = NS(u): five quintic Newton-Schulz iterations in bfloat16 (≈ the nearest
        semi-orthogonal matrix), after dividing u by max(||u||_F, ns_eps)
        (`ns_dtype` "float32" runs them in fp32, as DeepSpeed does without bf16 support;
        bfloat16 stays the default on CPUs too: with AVX512-BF16, as here, its matrix
        products are about twice as fast as fp32's, BENCHMARKS.md)
    w <- w (1 − lr · weight_decay) − lr' · O,  lr' = lr · √max(1, rows/cols)
        ("original") or 0.2 · lr · √max(rows, cols) ("match_rms_adamw")

Everything else (and matrices in a param group with `use_muon: False`): torch.optim.AdamW
with `adam_lr`, `betas`, `eps` and the shared `weight_decay`.

Under ZeRO a rank holds pieces of a matrix, but Newton-Schulz needs all of it. The
momentum is element-wise, so each rank updates its pieces and forms its part of u; then,
for each matrix in turn (the same order on every rank), every rank writes its part into a
zero matrix and the shard group sums: the sum is u exactly (one writer per element). Each
rank holding a piece orthogonalises the whole u (the same input gives the same output
everywhere) and keeps its piece. The sum is parameter-sized: it goes through
`sum_data_over_shards` (optim/sharded.py), and only one matrix is assembled at a time.

`use_muon` per param group: True, False, or None (default: Muon for parameters with
exactly two dimensions). Every parameter's state counts its steps (Muon's own rule does not
use the count) so that the scalars a checkpoint keeps per param group agree. DeepSpeed's configs give the Muon rate as `muon_lr` and the AdamW
one as `adam_lr`, both defaulting to `lr`; they are accepted under the same names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from math import prod
from typing import Any, Iterable, Literal

import torch

from shardwise.runtime.optim.closure import closure_loss
from shardwise.runtime.optim.layout import flat, parameter_shapes, params_with_grad
from shardwise.runtime.optim.params import check_betas, param
from shardwise.runtime.optim.registry import OptimizerSpec, register_optimizer
from shardwise.runtime.optim.sharded import ShardAwareOptimizer

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic, as torch.optim.Muon
ELEMENT_KEYS = ("momentum_buffer", "exp_avg", "exp_avg_sq")
NS_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


class MuonCodec:
    """Checkpoint form: the same three per-element tensors for every parameter, zeros for
    those a parameter does not use (a param group's saved keys must agree), and `step`."""

    def encode(self, state: dict[str, Any], numel: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        device = state["step"].device
        elements = {key: state.get(key, torch.zeros(numel, device=device)) for key in ELEMENT_KEYS}
        return elements, {"step": state["step"]}

    def decode(self, elements: dict[str, torch.Tensor], scalars: dict[str, Any]) -> dict[str, Any]:
        return {**scalars, **elements}  # the next step drops what the parameter does not use

    def state_bytes(self, state: dict[str, Any], numel: int) -> int:
        return sum(value.numel() * value.element_size() for value in state.values()
                   if torch.is_tensor(value) and value.dim() > 0)


class Muon(ShardAwareOptimizer):
    state_codec = MuonCodec()  # how the engine should checkpoint this optimizer's state

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        ns_eps: float = 1e-7,
        ns_steps: int = 5,
        ns_dtype: str = "bfloat16",
        adjust_lr_fn: str | None = None,
        muon_lr: float | None = None,
        adam_lr: float | None = None,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        use_muon: bool | None = None,
    ):
        if min(lr, weight_decay, momentum, ns_eps, eps) < 0 or ns_steps < 0:
            raise ValueError(f"lr {lr}, weight_decay {weight_decay}, momentum {momentum}, ns_eps {ns_eps}, "
                             f"eps {eps} and ns_steps {ns_steps} must not be negative")
        if not 0 <= ns_steps < 100:
            raise ValueError(f"ns_steps {ns_steps} must be below 100")
        if ns_dtype not in NS_DTYPES:
            raise ValueError(f"ns_dtype {ns_dtype!r} is not one of {', '.join(NS_DTYPES)}")
        if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
            raise ValueError(f"adjust_lr_fn {adjust_lr_fn!r} is not one of None, 'original', 'match_rms_adamw'")
        if not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"betas {tuple(betas)} must each lie in [0, 1)")
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=tuple(ns_coefficients), ns_eps=ns_eps, ns_steps=ns_steps, ns_dtype=ns_dtype,
                        adjust_lr_fn=adjust_lr_fn, muon_lr=muon_lr, adam_lr=adam_lr, betas=tuple(betas), eps=eps,
                        use_muon=use_muon)
        super().__init__(params, defaults)
        self._muon_shapes: dict[int, tuple[int, int]] | None = None  # parameter index -> shape, Muon's matrices

    def uses_muon(self, shape: tuple[int, ...], group: dict) -> bool:
        return len(shape) == 2 if group["use_muon"] is None else bool(group["use_muon"])

    def attach_shards(self, *args, **kwargs) -> None:
        """New pieces (ZeRO took the parameters over): the model-wide layout is learnt anew."""
        super().attach_shards(*args, **kwargs)
        self._muon_shapes = None

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        if self._muon_shapes is None:
            self._muon_shapes = self._find_muon_matrices()
        directions: dict[int, tuple[torch.Tensor, torch.Tensor, dict]] = {}
        adam: list[tuple[torch.Tensor, dict]] = []
        for param, group in params_with_grad(self):
            shard = self.shard_of(param)
            state = self._settle(param, group)
            state["step"] += 1
            if "momentum_buffer" in state:
                directions[shard.index] = (param, self._direction(param, state["momentum_buffer"], group), group)
            else:
                adam.append((param, group))
        self._muon_updates(directions)
        for param, group in adam:
            _adamw_step(param, self.state[param], group)
        return loss

    def _settle(self, param: torch.Tensor, group: dict) -> dict:
        """The state this parameter's rule needs, fresh or from a checkpoint load (which
        brings every per-element key)."""
        state = self.state[param]
        keep = ("momentum_buffer",) if self.uses_muon(self.shard_of(param).shape, group) else ("exp_avg", "exp_avg_sq")
        state.setdefault("step", torch.zeros((), dtype=torch.float32))
        for key in ELEMENT_KEYS:
            if key not in keep:
                state.pop(key, None)
            elif key not in state:
                state[key] = torch.zeros(param.numel(), dtype=torch.float32, device=param.device)
        return state

    @staticmethod
    def _direction(param: torch.Tensor, buffer: torch.Tensor, group: dict) -> torch.Tensor:
        grad = flat(param.grad)
        buffer.lerp_(grad, 1 - group["momentum"])
        return grad.lerp(buffer, group["momentum"]) if group["nesterov"] else buffer

    def _find_muon_matrices(self) -> dict[int, tuple[int, int]]:
        """Every Muon matrix of the model by index, the same on every rank: a rank must
        take part in the sum of a matrix of which it holds nothing, so the rule (the
        holders' param group) is shared with one small sum, once."""
        shapes = parameter_shapes(self)
        flags = torch.zeros(self.parameter_count, dtype=torch.float32)
        for group in self.param_groups:
            for param in group["params"]:
                shard = self.shard_of(param)
                if self.uses_muon(shard.shape, group):
                    if len(shard.shape) != 2:
                        raise ValueError(f"Muon trains 2-D parameters; {shard.name or shard.index} has shape "
                                         f"{shard.shape} (set use_muon false for its param group)")
                    flags[shard.index] = 1.0
        self.sum_over_shards(flags)
        return {index: shapes[index] for index in torch.nonzero(flags).flatten().tolist()}

    def _muon_updates(self, directions: dict[int, tuple[torch.Tensor, torch.Tensor, dict]]) -> None:
        """Every Muon matrix of the model, in index order (every rank of the shard group
        takes part in each sum, whether or not it holds a piece of that matrix)."""
        device = next((p.device for group in self.param_groups for p in group["params"]), torch.device("cpu"))
        for index, shape in sorted(self._muon_shapes.items()):
            whole = torch.zeros(math.prod(shape), dtype=torch.float32, device=device)
            if index in directions:
                param, direction, group = directions[index]
                shard = self.shard_of(param)
                whole[shard.start : shard.stop] = direction
            self.sum_data_over_shards(whole)
            if index not in directions:
                continue
            orthogonal = orthogonalize(whole.view(shape), group["ns_coefficients"], group["ns_steps"], group["ns_eps"],
                                       NS_DTYPES[group["ns_dtype"]])
            lr = group["lr"] if group["muon_lr"] is None else group["muon_lr"]
            param.mul_(1 - lr * group["weight_decay"])
            flat(param).add_(orthogonal.reshape(-1)[shard.start : shard.stop], alpha=-_adjusted_lr(lr, group, shape))


def orthogonalize(matrix: torch.Tensor, coefficients: tuple[float, float, float], steps: int,
                  eps: float, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Newton-Schulz iteration towards the nearest semi-orthogonal matrix, with
    torch.optim.Muon's arithmetic: X <- a X + (b A + c A²) X, A = X Xᵀ, on the wide
    orientation of the matrix, in `dtype` (torch's: bfloat16)."""
    a, b, c = coefficients
    x = matrix.to(dtype, copy=True)
    tall = matrix.size(0) > matrix.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def _adjusted_lr(lr: float, group: dict, shape: tuple[int, ...]) -> float:
    rows, cols = shape[:2]
    if group["adjust_lr_fn"] == "match_rms_adamw":
        return lr * (0.2 * math.sqrt(max(rows, cols)))
    return lr * math.sqrt(max(1, rows / cols))


def _adamw_step(param: torch.Tensor, state: dict, group: dict) -> None:
    """torch.optim.AdamW's single-tensor arithmetic."""
    lr = group["lr"] if group["adam_lr"] is None else group["adam_lr"]
    beta1, beta2 = group["betas"]
    grad, weights = flat(param.grad), flat(param)
    weights.mul_(1 - lr * group["weight_decay"])
    state["exp_avg"].lerp_(grad, 1 - beta1)
    state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step = state["step"].item()
    step_size = lr / (1 - beta1**step)
    denominator = (state["exp_avg_sq"].sqrt() / (1 - beta2**step) ** 0.5).add_(group["eps"])
    weights.addcdiv_(state["exp_avg"], denominator, value=-step_size)


def muon_state_bytes(shape: tuple[int, ...]) -> int:
    """Muon's state for one parameter: a momentum buffer for a matrix (4 bytes per element),
    AdamW's two moments otherwise (8)."""
    return (4 if len(shape) == 2 else 8) * prod(shape)


@dataclass(frozen=True)
class MuonParams:
    """Muon for 2-D parameters and AdamW for the rest: torch.optim.Muon's and
    torch.optim.AdamW's defaults, DeepSpeed's `muon_lr` / `adam_lr` keys (default: `lr`)."""

    lr: float = param(1e-3, ge=0)
    weight_decay: float = param(0.1, ge=0)
    momentum: float = param(0.95, ge=0)
    nesterov: bool = True
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS
    ns_eps: float = param(1e-7, ge=0)
    ns_steps: int = param(5, ge=0, lt=100)
    ns_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    adjust_lr_fn: Literal["original", "match_rms_adamw"] | None = None
    muon_lr: float | None = param(None, ge=0, default_doc="lr")
    adam_lr: float | None = param(None, ge=0, default_doc="lr")
    betas: tuple[float, float] = param((0.9, 0.999), check=check_betas)
    eps: float = param(1e-8, ge=0)


# K: the momentum of its matrices (the vectors it trains with AdamW hold 2, a negligible
# share of a transformer; the engine counts them exactly, `muon_state_bytes`). The main
# job scales its matrices' step to AdamW's RMS, so AdamW's learning rate carries over.
register_optimizer(OptimizerSpec(
    "Muon", MuonParams, lambda groups, params: Muon(groups, **params), fp32_states=lambda params: 1,
    codec=MuonCodec(), per_parameter=True,
    main_job_params=lambda adamw, steps: {**adamw, "adjust_lr_fn": "match_rms_adamw"},
))
