"""8-bit Adam and AdamW (C17): Adam whose two moments are stored block-wise quantised,
2 bytes per parameter instead of 8 (Dettmers et al., 2022; bitsandbytes' `Adam8bit` /
`AdamW8bit`).

Each step dequantises a piece's moments to fp32, takes Adam's step with them exactly as
bitsandbytes' CPU code does (the update uses the new, not yet quantised, moments), then
quantises them again: blocks of 256 elements of the parameter's flattened coordinates,
one fp32 absmax per block, a signed dynamic code for the first moment and an unsigned one
for the second (optim/quantization.py: the nearest code found by a table lookup on the
value's top bits, not a binary search). A piece boundary inside a block is handled by
taking that block's absmax over the shard group (optim/shared_blocks.py), so a
partitioned run quantises every block exactly as one process does.

As in bitsandbytes, parameters with fewer than `min_8bit_size` elements keep fp32
moments (their update then uses bitsandbytes' 32-bit arithmetic), and weight decay is
decoupled (p <- p (1 - lr wd)) for both classes: `Adam8bit` and `AdamW8bit` differ only
in their default weight decay. This differs from torch.optim.Adam, whose weight decay is
an L2 term added to the gradient.

Checkpoints save the moments dequantised, as fp32 per element (`Adam8bitCodec`), so they
reshard like Adam's; a loaded piece keeps fp32 moments until its next step quantises them.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Iterable, NamedTuple

import torch

from shardwise.runtime.optim import native
from shardwise.runtime.optim.layout import PaddedRows, flat, parameter_shapes, params_with_grad
from shardwise.runtime.optim.params import check_betas, param
from shardwise.runtime.optim.quantization import (BLOCK, CELL_SHIFT, Codebook, block_absmax, codebook, decade_rounding,
                                                  dequantize_piece, quantize)
from shardwise.runtime.optim.registry import OptimizerSpec, register_optimizer
from shardwise.runtime.optim.sharded import ShardAwareOptimizer
from shardwise.runtime.optim.shared_blocks import SharedBlocks, partial_blocks

MOMENTS = (("exp_avg", True), ("exp_avg_sq", False))  # state key, signed code
# A 1-byte code per element for each of the two moments, and an fp32 absmax per block of
# BLOCK elements for each: K's states (parameters under `min_8bit_size` keep fp32 moments,
# 8 bytes; the engine counts them exactly, `adam_8bit_state_bytes`).
STATE_BYTES = 2 + 2 * 4 / BLOCK


class Adam8bitCodec:
    """Checkpoint form: both moments as fp32 per element (dequantised), and `step`."""

    def encode(self, state: dict[str, Any], numel: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        elements = {}
        for key, signed in MOMENTS:
            if key in state:
                elements[key] = state[key]
            else:
                elements[key] = dequantize_piece(state[f"{key}_codes"], state[f"{key}_absmax"],
                                                 state["piece_start"], codebook(signed).to(state[f"{key}_absmax"].device))
        return elements, {"step": state["step"]}

    def decode(self, elements: dict[str, torch.Tensor], scalars: dict[str, Any]) -> dict[str, Any]:
        return {**scalars, **elements}

    def state_bytes(self, state: dict[str, Any], numel: int) -> int:
        return sum(value.numel() * value.element_size() for value in state.values()
                   if torch.is_tensor(value) and value.dim() > 0)


class Adam8bit(ShardAwareOptimizer):
    state_codec = Adam8bitCodec()  # how the engine should checkpoint this optimizer's state

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        min_8bit_size: int = 4096,
    ):
        if lr < 0 or eps < 0 or weight_decay < 0 or min_8bit_size < 0:
            raise ValueError(f"lr {lr}, eps {eps}, weight_decay {weight_decay} and min_8bit_size "
                             f"{min_8bit_size} must not be negative")
        if not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"betas {tuple(betas)} must each lie in [0, 1)")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, min_8bit_size=min_8bit_size)
        super().__init__(params, defaults)
        self._shared: SharedBlocks | None = None

    def attach_shards(self, *args, **kwargs) -> None:
        """New pieces (ZeRO took the parameters over): the model-wide layout is learnt anew."""
        super().attach_shards(*args, **kwargs)
        self._shared = None

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        trained = list(params_with_grad(self))
        if self._shared is None:
            quantised = [p for group in self.param_groups for p in group["params"]
                         if self.shard_of(p).full_numel >= group["min_8bit_size"]]
            self._shared = SharedBlocks.discover(self, parameter_shapes(self), quantised)
        cut: list[_CutRow] = []
        for param, group in trained:
            shard = self.shard_of(param)
            state = self.state[param]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros(shard.numel, dtype=torch.float32, device=param.device)
                state["exp_avg_sq"] = torch.zeros_like(state["exp_avg"])
            state["piece_start"] = shard.start
            state["step"] += 1
            step = state["step"].item()
            if shard.full_numel < group["min_8bit_size"]:  # fp32 moments (also if min_8bit_size grew)
                exp_avg, exp_avg_sq = self._moments(state)
                _adam_step(flat(param), flat(param.grad), exp_avg, exp_avg_sq, _Hyper.of(group, step), quantised=False)
                for (key, _), moment in zip(MOMENTS, (exp_avg, exp_avg_sq)):
                    state[key] = moment
                    state.pop(f"{key}_codes", None)
                    state.pop(f"{key}_absmax", None)
                continue
            blocks = PaddedRows.of(shard, BLOCK)
            quantised = self._native_step(param, state, blocks, _Hyper.of(group, step))
            if quantised is None:
                exp_avg, exp_avg_sq = self._moments(state)
                quantised = _step_and_quantise(flat(param), flat(param.grad), exp_avg, exp_avg_sq, shard.start,
                                               _Hyper.of(group, step), _codebooks(param.device))
            for k, (key, _) in enumerate(MOMENTS):
                codes, absmax, edges = quantised[3 * k : 3 * k + 3]
                state[f"{key}_codes"] = codes
                state[f"{key}_absmax"] = absmax
                state.pop(key, None)
                for block in partial_blocks(shard):
                    row = block - blocks.first_row
                    values = edges[0 if row == 0 else 1]
                    cut.append(_CutRow(state, k, self._shared.slot(shard.index, block), row, values, blocks))
        maxima = self._shared.maxima(self, [(c.slot, c.k, c.values) for c in cut], len(MOMENTS), _device(trained))
        for row in cut:
            row.requantise(maxima[row.slot, row.k])
        return loss

    def _native_step(self, param: torch.Tensor, state: dict, blocks: PaddedRows,
                     hyper: _Hyper) -> tuple[torch.Tensor, ...] | None:
        """The step in one pass per block (optim/native.py), from the coded moments or from
        fp32 ones (fresh, or loaded from a checkpoint), for fp32 CPU tensors. Returns what
        `_step_and_quantise` does, or None where the kernel does not apply."""
        if not (native.enabled() and param.dtype == param.grad.dtype == torch.float32
                and native.takes(param, param.grad)):
            return None
        if "exp_avg" in state:
            inputs = [state[key] for key, _ in MOMENTS]
            if not all(t.dtype == torch.float32 and t.numel() == blocks.numel and native.takes(t) for t in inputs):
                return None
            coded = []
            for _ in MOMENTS:
                coded += [torch.empty(blocks.numel, dtype=torch.uint8), torch.empty(blocks.rows)]
        else:
            inputs = [None, None]
            (m_codes, m_absmax), (v_codes, v_absmax) = (self._coded(state, key) for key, _ in MOMENTS)
            coded = [m_codes, m_absmax, v_codes, v_absmax]
            if not (native.takes(*coded) and m_codes.numel() == v_codes.numel() == blocks.numel
                    and m_absmax.numel() == v_absmax.numel() == blocks.rows
                    and m_absmax.dtype == v_absmax.dtype == torch.float32):
                return None
        books = [table.data_ptr() for signed in (True, False) for table in _native_codebook(signed)]
        edges = torch.empty(len(MOMENTS), 2, BLOCK)
        lr, beta1, beta2, eps, decay, correction1, correction2 = hyper
        native.library().adam8bit_step(
            param.data_ptr(), param.grad.data_ptr(), *(tensor.data_ptr() for tensor in coded), blocks.numel,
            blocks.offset, *books, beta1, 1.0 - beta1, beta2, 1.0 - beta2, eps, 1.0 - lr * decay, decay > 0.0,
            correction2, -lr / correction1, edges.data_ptr(), *(native.pointer(t) for t in inputs), native.threads())
        return coded[0], coded[1], edges[0], coded[2], coded[3], edges[1]

    @staticmethod
    def _coded(state: dict, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        """A moment's codes (as bytes: torch's load_state_dict casts state to the
        parameter's dtype) and block scales."""
        if state[f"{key}_codes"].dtype != torch.uint8:
            state[f"{key}_codes"] = state[f"{key}_codes"].to(torch.uint8)
        return state[f"{key}_codes"], state[f"{key}_absmax"]

    def _moments(self, state: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 moments of a piece: the stored ones (fresh, loaded, or a small parameter's),
        else the quantised ones dequantised."""
        moments = [state[key] if key in state
                   else dequantize_piece(*self._coded(state, key), state["piece_start"],
                                         codebook(signed).to(state[f"{key}_absmax"].device))
                   for key, signed in MOMENTS]
        return moments[0], moments[1]


class _CutRow:
    """One moment's values in a block cut by a piece boundary, quantised for now with this
    rank's partial absmax, to be quantised again once the block's true absmax is known."""

    def __init__(self, state: dict, k: int, slot: int, row: int, values: torch.Tensor, blocks: PaddedRows):
        self.state, self.k, self.slot, self.row, self.values = state, k, slot, row, values
        first = max(row * BLOCK, blocks.offset)
        last = min((row + 1) * BLOCK, blocks.offset + blocks.numel)
        self.in_piece = slice(first - blocks.offset, last - blocks.offset)
        self.in_row = slice(first - row * BLOCK, last - row * BLOCK)

    def requantise(self, absmax: torch.Tensor) -> None:
        key, signed = MOMENTS[self.k]
        absmax = absmax.reshape(1).to(self.values.device)
        codes = quantize(self.values.unsqueeze(0), absmax, codebook(signed).to(absmax.device))[0]
        self.state[f"{key}_codes"][self.in_piece] = codes[self.in_row]
        self.state[f"{key}_absmax"][self.row] = absmax[0]


def _codebooks(device: torch.device) -> tuple[Codebook, Codebook]:
    """The first moment's (signed) and the second's (unsigned) codebooks, on `device`."""
    return codebook(True).to(device), codebook(False).to(device)


@functools.cache
def _native_codebook(signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The native kernel's form of a codebook (native_kernels.c, `quantize_values`): the
    256 code values followed by their four byte planes (plane b: byte b of each value, for
    the VBMI decode), and per rounding cell one int32, the midpoints below the cell plus,
    shifted by 8, the least key (the value's low CELL_SHIFT bits, flipped for negative
    values so that the key grows with the value) above the cell's midpoint; 2^CELL_SHIFT
    where the cell has none. Derived from the table lookup's own tables, so the two round
    alike. The cells are followed by the AVX-512 encoder's words (`decade_rounding`),
    which round alike too."""
    book = codebook(signed)
    boundary = book.boundary.view(torch.int32).long() & 0xFFFFFFFF
    low = boundary & ((1 << CELL_SHIFT) - 1)
    negative = boundary >> 31 == 1
    threshold = torch.where(negative, (1 << CELL_SHIFT) - low, low + 1)
    threshold = torch.where(torch.isinf(book.boundary), 1 << CELL_SHIFT, threshold)
    cells = (book.below.long() | threshold << 8).to(torch.int32)
    planes = book.values.view(torch.uint8).view(-1, 4).t().contiguous().view(torch.float32).view(-1)
    return torch.cat([book.values, planes]), torch.cat([cells, decade_rounding(signed)])


def _device(trained: list[tuple[torch.Tensor, dict]]) -> torch.device:
    return trained[0][0].device if trained else torch.device("cpu")


class AdamW8bit(Adam8bit):
    """bitsandbytes' AdamW8bit: the same update as `Adam8bit`, weight decay 1e-2 by default."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, min_8bit_size: int = 4096):
        super().__init__(params, lr, betas, eps, weight_decay, min_8bit_size)


class _Hyper(NamedTuple):
    """A step's scalars."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    decay: float
    correction1: float  # 1 - beta1^t
    correction2: float  # sqrt(1 - beta2^t)

    @classmethod
    def of(cls, group: dict, step: float) -> "_Hyper":
        beta1, beta2 = group["betas"]
        return cls(group["lr"], beta1, beta2, group["eps"], group["weight_decay"],
                   1.0 - beta1**step, math.sqrt(1.0 - beta2**step))


def _step_and_quantise(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                       start: int, hyper: _Hyper, books: tuple[Codebook, Codebook]) -> tuple[torch.Tensor, ...]:
    """Adam's step on fp32 moments of the piece [start, start + numel), then per moment:
    its codes (the piece's own elements, not a padded buffer), its block scales
    from this piece alone, and its first and last padded rows in fp32 (a block cut by a
    piece boundary is quantised again from them once its whole absmax is known)."""
    _adam_step(param, grad, exp_avg, exp_avg_sq, hyper, quantised=True)
    blocks = PaddedRows(start, param.numel(), BLOCK)
    result: list[torch.Tensor] = []
    for book, moment in zip(books, (exp_avg, exp_avg_sq)):
        rows = blocks.pad(moment)
        absmax = block_absmax(rows)
        codes = blocks.unpad(quantize(rows, absmax, book))
        result += [codes if blocks.whole else codes.clone(),  # not the padded buffer
                   absmax, torch.stack([rows[0], rows[-1]])]
    return tuple(result)


def _adam_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
               hyper: _Hyper, quantised: bool) -> None:
    """bitsandbytes' arithmetic: its 8-bit blockwise update when `quantised`, its 32-bit
    update otherwise (the same mathematics, rounded differently)."""
    lr, beta1, beta2, eps, decay, correction1, correction2 = hyper
    exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
    if decay > 0.0:
        param.mul_(1.0 - lr * decay)
    if quantised:
        param.addcdiv_(exp_avg, (exp_avg_sq.sqrt() / correction2).add_(eps), value=-lr / correction1)
    else:
        param.add_(exp_avg / (exp_avg_sq.sqrt() + eps * correction2), alpha=-lr * correction2 / correction1)


def adam_8bit_state_bytes(start: int, stop: int, numel: int, min_8bit_size: int = 4096) -> int:
    """8-bit Adam's state for elements [start, stop) of a parameter of `numel` elements: 2
    codes per element and 2 fp32 scales per block touched (a block cut by a ZeRO piece
    boundary is held, with its scales, by each rank it spans); fp32 moments (8 bytes per
    element) below `min_8bit_size` elements."""
    if numel < min_8bit_size:
        return 8 * (stop - start)
    blocks = (stop - 1) // BLOCK - start // BLOCK + 1 if stop > start else 0
    return 2 * (stop - start) + 8 * blocks


@dataclass(frozen=True)
class Adam8bitParams:
    """8-bit Adam with bitsandbytes' `Adam8bit` defaults; weight decay is decoupled, as
    bitsandbytes applies it."""

    lr: float = param(1e-3, ge=0)
    betas: tuple[float, float] = param((0.9, 0.999), check=check_betas)
    eps: float = param(1e-8, ge=0)
    weight_decay: float = param(0.0, ge=0)
    min_8bit_size: int = param(4096, ge=0, description="parameters with fewer elements keep fp32 moments")


@dataclass(frozen=True)
class AdamW8bitParams(Adam8bitParams):
    """bitsandbytes' `AdamW8bit`: `Adam8bit` with weight decay 1e-2 by default."""

    weight_decay: float = param(1e-2, ge=0)


register_optimizer(OptimizerSpec(
    "Adam8bit", Adam8bitParams, lambda groups, params: Adam8bit(groups, **params),
    fp32_states=lambda params: STATE_BYTES / 4, codec=Adam8bitCodec(), per_parameter=True,
))
register_optimizer(OptimizerSpec(
    "AdamW8bit", AdamW8bitParams, lambda groups, params: AdamW8bit(groups, **params),
    fp32_states=lambda params: STATE_BYTES / 4, codec=Adam8bitCodec(), per_parameter=True,
))
