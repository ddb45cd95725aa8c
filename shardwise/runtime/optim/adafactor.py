"""Adafactor (Shazeer & Stern, 2018), with torch.optim.Adafactor's semantics and
defaults (C17): a second moment that, for a matrix, keeps only row and column means of
the squared gradient, so its state is O(rows + columns) instead of O(rows · columns).

Per parameter, at step t (torch's formulation, which applies eps1 as a floor on the
estimate rather than adding it to the squared gradient, and uses lr as the bound of the
relative step and as the decoupled weight-decay coefficient):

    β̂2 = 1 − t^beta2_decay,   ρ = min(lr, 1/√t),   α = max(eps2, RMS(w)) · ρ
    w <- w (1 − lr · weight_decay)
    matrices (last two dims factored):  R <- β̂2 R + (1 − β̂2) mean_cols(g²)
                                        C <- β̂2 C + (1 − β̂2) mean_rows(g²)
                                        V = R Cᵀ / max(mean(R), eps1)
    other tensors:                      V <- β̂2 V + (1 − β̂2) g²
    U = g / max(√V, eps1),   w <- w − α U / max(1, RMS(U) / d)

eps1 None means the dtype's machine epsilon. There is no first moment (torch's has none).

Under ZeRO every statistic is of the whole parameter: a rank sums its pieces' squared
rows, columns and norms, one sum over the shard group completes them (with the stored
row / column statistics, which each rank keeps only in part: optim/adafactor_layout.py),
and a second sum completes RMS(U). On one process, whole parameters give torch's
arithmetic operation for operation.

On CPU, fp32 tensors step in native kernels (optim/native.py; `SHARDWISE_NATIVE_OPTIM=0`
keeps the torch path above): a matrix in three passes (the weight's, rows' and columns'
squares in one; RMS(U); the update), a tensor that is not factored in two, U computed
without a per-element division or square root. They agree with the torch path to fp32
rounding, not bit for bit (their sums are in double). Without ZeRO each parameter's
passes run back to back, while it is still in the cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from math import prod
from typing import Any, Iterable

import torch

from shardwise.runtime.optim.closure import closure_loss
from shardwise.runtime.optim import native
from shardwise.runtime.optim.adafactor_layout import Factoring
from shardwise.runtime.optim.layout import PaddedRows, flat, parameter_shapes, params_with_grad
from shardwise.runtime.optim.params import param
from shardwise.runtime.optim.registry import OptimizerSpec, register_optimizer
from shardwise.runtime.optim.sharded import ParameterShard, ShardAwareOptimizer

FACTORED_KEYS = ("row_var", "col_var")
LOADED = "loaded_"  # prefix of per-element statistics a checkpoint load left for the next step
# K depends on the shapes: 4 (rows + columns) bytes per matrix. With only Ψ known, the
# registry's K assumes square matrices of this side (transformer weights are larger, so the
# real K is smaller still).
REFERENCE_SIDE = 1024


class AdafactorCodec:
    """Checkpoint form, the same three per-element tensors for every parameter (so a param
    group's saved keys agree): `variance`, and `row_var` / `col_var` written at their
    rows' and columns' first elements (optim/adafactor_layout.py), zeros elsewhere."""

    def encode(self, state: dict[str, Any], numel: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        device = state["step"].device
        elements = {key: state.get(LOADED + key, torch.zeros(numel, device=device)) for key in FACTORED_KEYS}
        elements["variance"] = state.get("variance", torch.zeros(numel, device=device))
        if "row_var" in state:
            start, shape = state["piece"]
            factoring = Factoring.of(shape)
            elements["row_var"][factoring.row_start_positions(start, start + numel)] = state["row_var"]
            elements["col_var"][factoring.first_row_positions(start, start + numel)] = state["col_var"]
        return elements, {"step": state["step"]}

    def decode(self, elements: dict[str, torch.Tensor], scalars: dict[str, Any]) -> dict[str, Any]:
        return {**scalars, "variance": elements["variance"],
                **{LOADED + key: elements[key] for key in FACTORED_KEYS}}

    def state_bytes(self, state: dict[str, Any], numel: int) -> int:
        return sum(value.numel() * value.element_size() for value in state.values()
                   if torch.is_tensor(value) and value.dim() > 0)


class Adafactor(ShardAwareOptimizer):
    state_codec = AdafactorCodec()  # how the engine should checkpoint this optimizer's state

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-2,
        beta2_decay: float = -0.8,
        eps: tuple[float | None, float] = (None, 1e-3),
        d: float = 1.0,
        weight_decay: float = 0.0,
        *,
        foreach: bool | None = None,
        maximize: bool = False,
    ):
        """torch.optim.Adafactor's signature: `foreach` chooses torch's multi-tensor or
        per-tensor loops, which compute the same; here the native kernels or the torch path
        step either way, so it is kept in the param groups (as torch keeps it) and read by
        nothing."""
        if lr < 0:
            raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
        if beta2_decay > 0:
            raise ValueError(f"beta2_decay should be <= 0 but is: {beta2_decay}")
        if eps[0] is not None and eps[0] < 0 or eps[1] < 0:
            raise ValueError(f"eps {tuple(eps)}: epsilon1 (or None) and epsilon2 should be >= 0")
        if d < 1:
            raise ValueError(f"Clipping threshold d should be >= 1 but is: {d}")
        if weight_decay < 0:
            raise ValueError(f"weight_decay should be >= 0 but is: {weight_decay}")
        defaults = dict(lr=lr, beta2_decay=beta2_decay, eps=tuple(eps), d=d, weight_decay=weight_decay,
                        foreach=foreach, maximize=maximize)
        super().__init__(params, defaults)
        self._offsets: list[int] | None = None  # per parameter index, its statistics in the step's sum
        self._factorings: list[Factoring | None] = []

    def attach_shards(self, *args, **kwargs) -> None:
        """New pieces (ZeRO took the parameters over): the model-wide layout is learnt anew."""
        super().attach_shards(*args, **kwargs)
        self._offsets = None

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        if self._offsets is None:
            self._lay_out(parameter_shapes(self))
        trained = list(params_with_grad(self))
        steps = _advance_steps([self.state[param] for param, _ in trained])
        kernels = native.enabled()  # (read once per step: it looks at the environment)
        pieces = [_Piece(self, param, group, step, kernels) for (param, group), step in zip(trained, steps)]
        device = pieces[0].param.device if pieces else torch.device("cpu")
        totals = torch.zeros(self._offsets[-1], dtype=torch.float64, device=device)
        update_squares = torch.zeros(self.parameter_count, dtype=torch.float64, device=device)
        if not self.sharded and all(piece.native for piece in pieces):
            self._step_each_in_cache(pieces, totals, update_squares)
            return loss
        for piece in pieces:
            piece.contribute(totals, self._offsets[piece.shard.index], update_squares)
        self.sum_over_shards(totals)
        for piece in pieces:
            piece.advance(totals, self._offsets[piece.shard.index])
            piece.add_update_square(update_squares)
        self.sum_over_shards(update_squares)
        for piece, (weight_square, update_square) in zip(pieces, self._read_norms(pieces, totals, update_squares)):
            piece.apply(math.sqrt(weight_square), math.sqrt(update_square))
        return loss

    @property
    def sharded(self) -> bool:
        """Whether ZeRO cut the parameters into pieces (a shard group to sum over)."""
        return getattr(self, "_sum", None) is not None

    def _step_each_in_cache(self, pieces: list[_Piece], totals: torch.Tensor, update_squares: torch.Tensor) -> None:
        """Whole parameters in the native kernels: each parameter's three passes one after
        the other, so the second and third find its gradient and weights in the cache the
        first brought them into (the batched order of `step` streams every pass over all
        parameters from memory, which ZeRO needs: a sum over the shard group between
        passes). The same arithmetic per parameter, so the same result."""
        sums, squares = totals.numpy(), update_squares.numpy()  # CPU: views, read without a copy
        for piece in pieces:
            offset = self._offsets[piece.shard.index]
            if not piece.advance_whole_in_place(totals, offset):
                piece.contribute(totals, offset, update_squares)
                piece.advance(totals, offset)
            piece.add_update_square(update_squares)
            piece.apply(math.sqrt(sums[offset]), math.sqrt(squares[piece.shard.index]))

    def _read_norms(self, pieces: list[_Piece], totals: torch.Tensor,
                    update_squares: torch.Tensor) -> list[tuple[float, float]]:
        """Every piece's whole-parameter squared norms of weight and update, brought to
        the host in one transfer per step (not two per parameter). The step size must be
        a host number: torch.optim.Adafactor's `add_(update, alpha=step size)` fuses the
        multiply into the add, which a step size kept on the device (a multiply, then an
        add) would not reproduce bit for bit."""
        if not pieces:
            return []
        weights = torch.tensor([self._offsets[piece.shard.index] for piece in pieces], device=totals.device)
        updates = torch.tensor([piece.shard.index for piece in pieces], device=totals.device)
        values = torch.cat([totals[weights], update_squares[updates]]).tolist()
        return list(zip(values[: len(pieces)], values[len(pieces) :]))

    def _lay_out(self, shapes: list[tuple[int, ...] | None]) -> None:
        """Per parameter: its squared norm, then (matrices) squared row and column sums and
        stored row and column statistics, at offsets every rank agrees on."""
        self._factorings = [None if shape is None else Factoring.of(shape) for shape in shapes]
        self._offsets = [0]
        for factoring in self._factorings:
            size = 1 + (0 if factoring is None else 2 * (factoring.rows + factoring.columns))
            self._offsets.append(self._offsets[-1] + size)


class _Piece:
    """One trained tensor's step: what it adds to the shard group's sums, then its update."""

    def __init__(self, optimizer: Adafactor, param: torch.Tensor, group: dict, step: float, kernels: bool):
        """`step`: this step's count (`_advance_steps`); `kernels`: whether the native
        kernels are on."""
        self.param, self.group = param, group
        self.shard: ParameterShard = optimizer.shard_of(param)
        self.factoring = optimizer._factorings[self.shard.index]
        self.grad = flat(param.grad).neg() if group["maximize"] else flat(param.grad)
        self.eps1 = group["eps"][0] if group["eps"][0] is not None else torch.finfo(param.dtype).eps
        self.state = optimizer.state[param]
        self.step = step
        self.weight = self.step ** group["beta2_decay"]
        self.state["piece"] = (self.shard.start, self.shard.shape)
        self._settle_state()
        if self.factoring is not None:
            self.padded = PaddedRows.of(self.shard, self.factoring.width)
        # the step in the native kernels (optim/native.py) where they take the tensors
        self.native = param.dtype == self.grad.dtype == torch.float32 and kernels and native.takes(param, self.grad)

    def _settle_state(self) -> None:
        """Fresh state, or statistics loaded per element, into this parameter's form."""
        state, shard, factoring = self.state, self.shard, self.factoring
        loaded = {key: state.pop(LOADED + key, None) for key in FACTORED_KEYS}
        if factoring is None:
            state.setdefault("variance", torch.zeros(shard.numel, device=self.param.device))
            return
        state.pop("variance", None)
        for key, stored, positions in (("row_var", factoring.stored_rows, factoring.row_start_positions),
                                       ("col_var", factoring.stored_columns, factoring.first_row_positions)):
            if loaded[key] is not None:
                at = positions(shard.start, shard.stop).to(loaded[key].device)
                state[key] = loaded[key][at].clone()
            elif key not in state:
                part = stored(shard.start, shard.stop)
                state[key] = torch.zeros(part.stop - part.start, device=self.param.device)

    def contribute(self, totals: torch.Tensor, offset: int, update_squares: torch.Tensor) -> None:
        """Adds this piece's squares (weight; matrices: gradient rows and columns, and the
        stored statistics) to `totals`. A tensor that is not factored needs no sum over the
        shard group for V, so its kernel also advances V and adds U² to `update_squares`."""
        factoring, shard = self.factoring, self.shard
        if self.native and factoring is None:
            native.library().adafactor_vector_squares(
                self.param.data_ptr(), self.grad.data_ptr(), self.state["variance"].data_ptr(), shard.numel,
                self.weight, self.eps1 * self.eps1, totals.data_ptr() + 8 * offset,
                update_squares.data_ptr() + 8 * shard.index)
            return
        if self.native:
            self._native_squares(totals, offset)
        else:
            totals[offset] += _square(flat(self.param))
            if factoring is None:
                return
            self._contribute_squares(totals, offset)
        r, c = factoring.rows, factoring.columns
        stored_rows = factoring.stored_rows(shard.start, shard.stop)
        stored_columns = factoring.stored_columns(shard.start, shard.stop)
        base = offset + 1 + r + c
        totals[base + stored_rows.start : base + stored_rows.stop] += self.state["row_var"].double()
        totals[base + r + stored_columns.start : base + r + stored_columns.stop] += self.state["col_var"].double()

    def _native_squares(self, totals: torch.Tensor, offset: int) -> None:
        """Pass 1 in the native kernels: the weight's, rows' and columns' squares in one pass,
        into `totals` at this parameter's offset."""
        factoring, shard, at = self.factoring, self.shard, totals.data_ptr()
        native.library().adafactor_squares(
            self.param.data_ptr(), self.grad.data_ptr(), shard.numel, shard.start, factoring.width, factoring.height,
            at + 8 * (offset + 1), at + 8 * (offset + 1 + factoring.rows), at + 8 * offset, native.threads())

    def _contribute_squares(self, totals: torch.Tensor, offset: int) -> None:
        """The rows' and columns' squared sums of the gradient, in torch."""
        factoring = self.factoring
        rows = self.padded.pad(self.grad)
        first = offset + 1
        totals[first + self.padded.first_row : first + self.padded.first_row + self.padded.rows] += (
            factoring.row_squares(rows).double())
        first_matrix, columns = factoring.column_squares(rows, self.padded)
        start = first + factoring.rows + first_matrix * factoring.width
        totals[start : start + columns.numel()] += columns.reshape(-1).double()

    def advance(self, totals: torch.Tensor, offset: int) -> None:
        """Update the second-moment statistics (the whole matrix's, on every rank holding a
        piece of it) and keep this rank's stored part."""
        if self.factoring is None:
            if not self.native:  # (the kernel advanced it in `contribute`)
                self.state["variance"].lerp_(self.grad * self.grad, self.weight)
            return
        factoring, shard = self.factoring, self.shard
        r, c = factoring.rows, factoring.columns
        device, first = self.param.device, offset + 1
        sums = totals[first : first + 2 * (r + c)].to(device=device, dtype=torch.float32)
        row_mean, col_mean = sums[:r].div_(factoring.width), sums[r : r + c].div_(factoring.height)
        self.row_var = sums[r + c : 2 * r + c].lerp_(row_mean, self.weight)
        self.col_var = sums[2 * r + c :].lerp_(col_mean, self.weight)
        if self.native:  # per matrix, the mean of its rows' statistics (`Factoring.variance`'s)
            self.row_means = self.row_var.view(factoring.batches, factoring.height).mean(dim=1).clamp_(min=self.eps1)
        self.state["row_var"].copy_(self.row_var[factoring.stored_rows(shard.start, shard.stop)])
        self.state["col_var"].copy_(self.col_var[factoring.stored_columns(shard.start, shard.stop)])

    def advance_whole_in_place(self, totals: torch.Tensor, offset: int) -> bool:
        """`contribute` then `advance` for a whole factored tensor in the native kernels
        (no other rank holds a piece of it): pass 1's kernel, then the stored statistics
        advanced in place by one more (`adafactor_advance_whole`, the same values as
        `advance`'s torch operations), not through `totals` in a dozen small torch calls.
        False (nothing done) for any other piece."""
        factoring, state = self.factoring, self.state
        if not (self.native and factoring is not None and self.shard.numel == self.shard.full_numel
                and state["row_var"].numel() == factoring.rows and state["col_var"].numel() == factoring.columns):
            return False
        self._native_squares(totals, offset)
        r, at = factoring.rows, totals.data_ptr() + 8 * (offset + 1)
        self.row_var, self.col_var = state["row_var"], state["col_var"]
        native.library().adafactor_advance_whole(at, at + 8 * r, self.row_var.data_ptr(), self.col_var.data_ptr(), r,
                                                 factoring.columns, factoring.width, factoring.height, self.weight)
        self.row_means = self.row_var.view(factoring.batches, factoring.height).mean(dim=1).clamp_(min=self.eps1)
        return True

    def add_update_square(self, update_squares: torch.Tensor) -> None:
        """Adds this piece's sum of U² to its parameter's entry of `update_squares`."""
        if self.native and self.factoring is None:
            return  # added in `contribute`
        if self.native:
            self._native_call("adafactor_update_square", update_squares.data_ptr() + 8 * self.shard.index)
        else:
            update_squares[self.shard.index] += _square(self.update())

    def update(self) -> torch.Tensor:
        """U = g / max(√V, eps1), for this piece (computed again in `apply` rather than
        kept, so only one piece's update is alive at a time)."""
        if self.factoring is None:
            estimate = self.state["variance"].clone()
            return estimate.clamp_(min=self.eps1 * self.eps1).rsqrt_().mul_(self.grad)
        estimate = self.factoring.variance(self.row_var, self.col_var, self.padded, self.eps1)
        update = estimate.clamp_(min=self.eps1 * self.eps1).rsqrt_().mul_(self.padded.pad(self.grad))
        return self.padded.unpad(update)

    def apply(self, weight_norm: float, update_norm: float) -> None:
        group, numel = self.group, self.shard.full_numel
        rho = min(group["lr"], 1 / (self.step**0.5))
        alpha = max(group["eps"][1], weight_norm / (numel**0.5)) * rho
        denominator = max(1.0, update_norm / ((numel**0.5) * group["d"]))
        decay = group["weight_decay"] != 0
        if self.native and self.factoring is None:
            native.library().adafactor_vector_apply(
                self.param.data_ptr(), self.grad.data_ptr(), self.state["variance"].data_ptr(), self.shard.numel,
                self.eps1 * self.eps1, 1 - group["lr"] * group["weight_decay"], decay, -alpha / denominator)
            return
        if self.native:  # the decay and the update in one pass, U computed again
            self._native_call("adafactor_apply", 1 - group["lr"] * group["weight_decay"], decay,
                              -alpha / denominator, param=self.param.data_ptr())
            return
        if decay:
            self.param.mul_(1 - group["lr"] * group["weight_decay"])
        flat(self.param).add_(self.update(), alpha=-alpha / denominator)

    def _native_call(self, kernel: str, *arguments: Any, param: int | None = None) -> None:
        """A native kernel over this piece's U: the statistics as `update` reads them."""
        factoring, shard = self.factoring, self.shard
        leading = () if param is None else (param,)
        getattr(native.library(), kernel)(
            *leading, self.grad.data_ptr(), shard.numel, shard.start, factoring.width, factoring.height,
            self.row_var.data_ptr(), self.col_var.data_ptr(), self.row_means.data_ptr(), self.eps1 * self.eps1,
            *arguments, native.threads())


def _advance_steps(states: list[dict]) -> list[float]:
    """Every trained tensor's step count advanced (created at 0 where new) in one kernel
    for all of them; read back from the counters themselves, which live in host memory,
    as torch's optimizers keep them (a read waits for no device)."""
    for state in states:
        if not state:
            state["step"] = torch.tensor(0.0)
    counts = [state["step"] for state in states]
    if counts:
        torch._foreach_add_(counts, 1)
    return [count.item() for count in counts]


def _square(values: torch.Tensor) -> torch.Tensor:
    """Squared L2 norm in float64 of the fp32 norm (exact: a float's square fits a double),
    so one piece that is the whole parameter gives back exactly torch's `tensor.norm()`.
    Stays on the device: the sums it enters are read once, in `_read_norms`."""
    return torch.linalg.vector_norm(values).double().square()


def adafactor_fp32_states(rows: int, columns: int) -> float:
    """Adafactor's fp32 values per element of a rows x columns matrix: one per row and one
    per column."""
    return (rows + columns) / (rows * columns)


def adafactor_state_bytes(shape: tuple[int, ...]) -> int:
    """Adafactor's state for one parameter: 4 (rows + columns) bytes for a tensor of 2 or
    more dimensions (factored over its last two: rows = all but the last dimension,
    columns = the last times the leading ones), 4 per element otherwise."""
    numel = prod(shape)
    if len(shape) < 2:
        return 4 * numel
    return 4 * (numel // shape[-1] + numel // shape[-2])


def _check_eps(eps: tuple[float | None, float]) -> tuple[float | None, float]:
    if (eps[0] is not None and eps[0] < 0) or eps[1] < 0:
        raise ValueError(f"eps {list(eps)}: epsilon1 must be null or >= 0, epsilon2 >= 0")
    return eps


@dataclass(frozen=True)
class AdafactorParams:
    """Adafactor with torch.optim.Adafactor's parameters and defaults."""

    lr: float = param(1e-2, ge=0)
    beta2_decay: float = param(-0.8, le=0)
    eps: tuple[float | None, float] = param(
        (None, 1e-3), check=_check_eps, description="(epsilon1: floor of the second-moment estimate, null for "
        "the dtype's machine epsilon; epsilon2: floor of a parameter's RMS in the step size)")
    d: float = param(1.0, ge=1)
    weight_decay: float = param(0.0, ge=0)
    foreach: bool | None = param(None, description="torch's choice between its multi-tensor and per-tensor "
                                 "loops, which compute the same: accepted, and shardwise's kernels step either way")
    maximize: bool = False


# torch's Adafactor steps by lr x RMS(w) and decays by lr x weight_decay per step: the main
# job's AdamW settings do not carry over.
register_optimizer(OptimizerSpec(
    "Adafactor", AdafactorParams, lambda groups, params: Adafactor(groups, **params),
    fp32_states=lambda params: adafactor_fp32_states(REFERENCE_SIDE, REFERENCE_SIDE),
    codec=AdafactorCodec(), per_parameter=True,
    main_job_params=lambda adamw, steps: {"lr": 3e-2, "weight_decay": 0.01},
))
