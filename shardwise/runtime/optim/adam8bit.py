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

On CPU fp32 tensors step in the native kernels (optim/native.py), on a GPU in a Triton
kernel (optim/triton_kernels.py), each one pass per block; elsewhere the torch path below.

Checkpoints save the moments dequantised, as fp32 per element (`Adam8bitCodec`), so they
reshard like Adam's; a loaded piece keeps fp32 moments until its next step quantises them.
"""

from __future__ import annotations

import abc
import ctypes
import functools
import math
import operator
import threading
from dataclasses import dataclass
from typing import Any, Iterable, NamedTuple

import torch

from shardwise.runtime.optim.closure import closure_loss
from shardwise.runtime.optim import native, triton_gate
from shardwise.runtime.optim.layout import PaddedRows, flat, parameter_shapes, params_with_grad
from shardwise.runtime.optim.params import check_betas, param
from shardwise.runtime.optim.quantization import (BLOCK, CELL_SHIFT, Codebook, block_absmax, codebook, decade_rounding,
                                                  dequantize_piece, quantize)
from shardwise.runtime.optim.registry import OptimizerSpec, register_optimizer
from shardwise.runtime.optim.sharded import ParameterShard, ShardAwareOptimizer
from shardwise.runtime.optim.shared_blocks import SharedBlocks, partial_blocks

MOMENTS = (("exp_avg", True), ("exp_avg_sq", False))  # state key, signed code
CODED_KEYS = tuple(f"{key}_{part}" for key, _ in MOMENTS for part in ("codes", "absmax"))
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
        self._batched: dict[torch.Tensor, _CodedPiece | _Fp32Piece] = {}

    def attach_shards(self, *args, **kwargs) -> None:
        """New pieces (ZeRO took the parameters over): the model-wide layout is learnt anew."""
        super().attach_shards(*args, **kwargs)
        self._shared = None
        self._batched = {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A new state: the kept pieces (which would notice it) let go of the old one now."""
        super().load_state_dict(state_dict)
        self._batched = {}

    @torch.no_grad()
    def step(self, closure=None):
        """Tensors in their steady state (CPU fp32, state made by an earlier step, the
        kernels built and on) are stepped together by the batched kernels; the others (a
        first step, moments loaded in fp32, other dtypes or devices, the kernels off) one
        at a time. Both compute the same, bit for bit."""
        loss = closure_loss(closure)
        trained = list(params_with_grad(self))
        if self._shared is None:
            quantised = [p for group in self.param_groups for p in group["params"]
                         if self.shard_of(p).full_numel >= group["min_8bit_size"]]
            self._shared = SharedBlocks.discover(self, parameter_shapes(self), quantised)
        native_on = native.enabled()
        groups: dict[int, _Group] = {}
        coded: list[_CodedDescriptor] = []
        small: list[_Fp32Piece] = []
        cut: list[_CutValues] = []
        for param, group in trained:
            state = self.state[param]
            piece = self._batched.get(param)
            if not (native_on and piece is not None and piece.current(param, state, group["min_8bit_size"])):
                piece = self._batchable(param, state, group) if native_on else None
            if piece is None:
                self._batched.pop(param, None)
                cut += self._step_alone(param, state, group)
                continue
            self._batched[param] = piece
            hyper = groups.get(id(group))
            if hyper is None:
                hyper = groups[id(group)] = _Group.of(group)
            descriptor = piece.refresh(param, hyper)
            if isinstance(piece, _Fp32Piece):
                small.append(piece)
            else:
                coded.append(descriptor)
                if piece.cut:
                    cut += piece.cut_values()
        _step_batched(coded, small)
        if len(self._shared):  # a block cut by a piece boundary somewhere in the shard group
            maxima = self._shared.maxima(self, [(c.block.slot, c.k, c.values) for c in cut], len(MOMENTS),
                                         _device(trained))
            for values in cut:
                values.requantise(maxima[values.block.slot, values.k])
        return loss

    def _batchable(self, param: torch.Tensor, state: dict, group: dict) -> _CodedPiece | _Fp32Piece | None:
        """The tensor's piece for the batched kernels where it has one now: its state made
        by an earlier step, CPU fp32 tensors and, for 8 bits, moments coded (None: it steps
        alone)."""
        if not state or not _on_cpu_in_fp32(param):
            return None
        shard = self.shard_of(param)
        if shard.full_numel < group["min_8bit_size"]:
            return _Fp32Piece.of(state, shard)
        if MOMENTS[0][0] in state or not _Piece.takes_state(state, CODED_KEYS):
            return None
        coded = [tensor for key, _ in MOMENTS for tensor in self._coded(state, key)]
        if not _kernel_takes(coded, PaddedRows.of(shard, BLOCK)):
            return None
        state["piece_start"] = shard.start
        cut = [_CutBlock.of(shard, block, self._shared.slot(shard.index, block)) for block in partial_blocks(shard)]
        return _CodedPiece(state, shard, cut)

    def _step_alone(self, param: torch.Tensor, state: dict, group: dict) -> list[_CutValues]:
        """One tensor's step (its first, or from fp32 moments loaded, or not a CPU fp32
        tensor); returns the values of its cut blocks."""
        shard = self.shard_of(param)
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros(shard.numel, dtype=torch.float32, device=param.device)
            state["exp_avg_sq"] = torch.zeros_like(state["exp_avg"])
        state["piece_start"] = shard.start
        state["step"] += 1
        hyper = _Hyper.of(group, state["step"].item())
        if shard.full_numel < group["min_8bit_size"]:  # fp32 moments (also if min_8bit_size grew)
            exp_avg, exp_avg_sq = self._moments(state)
            _adam_step(flat(param), flat(param.grad), exp_avg, exp_avg_sq, hyper, quantised=False)
            for (key, _), moment in zip(MOMENTS, (exp_avg, exp_avg_sq)):
                state[key] = moment
                state.pop(f"{key}_codes", None)
                state.pop(f"{key}_absmax", None)
            return []
        blocks = PaddedRows.of(shard, BLOCK)
        quantised = self._native_step(param, state, blocks, hyper)
        if quantised is None:
            quantised = self._triton_step(param, state, blocks, hyper)
        if quantised is None:
            exp_avg, exp_avg_sq = self._moments(state)
            quantised = _step_and_quantise(flat(param), flat(param.grad), exp_avg, exp_avg_sq, shard.start, hyper,
                                           _codebooks(param.device))
        cut = []
        for k, (key, _) in enumerate(MOMENTS):
            codes, absmax, edges = quantised[3 * k : 3 * k + 3]
            state[f"{key}_codes"] = codes
            state[f"{key}_absmax"] = absmax
            state.pop(key, None)
            for block in partial_blocks(shard):
                where = _CutBlock.of(shard, block, self._shared.slot(shard.index, block))
                cut.append(_CutValues(state, k, where, edges[where.edge]))
        return cut

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
            coded = [tensor for key, _ in MOMENTS for tensor in self._coded(state, key)]
            if not _kernel_takes(coded, blocks):
                return None
        edges = torch.empty(len(MOMENTS), 2, BLOCK)
        lr, beta1, beta2, eps, decay, correction1, correction2 = hyper
        native.library().adam8bit_step(
            param.data_ptr(), param.grad.data_ptr(), *(tensor.data_ptr() for tensor in coded), blocks.numel,
            blocks.offset, *_native_books(), beta1, 1.0 - beta1, beta2, 1.0 - beta2, eps, 1.0 - lr * decay,
            decay > 0.0, correction2, -lr / correction1, edges.data_ptr(), *(native.pointer(t) for t in inputs),
            native.threads())
        return coded[0], coded[1], edges[0], coded[2], coded[3], edges[1]

    def _triton_step(self, param: torch.Tensor, state: dict, blocks: PaddedRows,
                     hyper: _Hyper) -> tuple[torch.Tensor, ...] | None:
        """The step in one pass per block on a GPU (optim/triton_kernels.py), codes
        rewritten in place; returns what `_step_and_quantise` does, or None where the
        kernel does not apply (not fp32 GPU tensors, or Triton missing)."""
        if not triton_gate.takes(param, param.grad):
            return None
        moments = coded = None
        if "exp_avg" in state:
            moments = tuple(state[key] for key, _ in MOMENTS)
            if not (triton_gate.takes(*moments) and all(t.numel() == blocks.numel for t in moments)):
                return None
        else:
            coded = tuple(tensor for key, _ in MOMENTS for tensor in self._coded(state, key))
            if not (all(t.device == param.device and t.is_contiguous() for t in coded)
                    and _kernel_sizes_fit(coded, blocks)):
                return None
        lr, beta1, beta2, eps, decay, correction1, correction2 = hyper
        return triton_gate.kernels().adam8bit_step(
            param.view(-1), param.grad.view(-1), moments=moments, coded=coded, offset=blocks.offset,
            rows=blocks.rows, lr=lr, beta1=beta1, beta2=beta2, eps=eps, decay=decay, correction1=correction1,
            correction2=correction2)

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


def _on_cpu_in_fp32(param: torch.Tensor) -> bool:
    """Whether the batched kernels take this tensor: it and its gradient contiguous fp32 on
    the CPU."""
    grad = param.grad
    return (param.dtype == grad.dtype == torch.float32 and param.is_cpu and grad.is_cpu and param.is_contiguous()
            and grad.is_contiguous())


def _kernel_takes(coded: list[torch.Tensor], blocks: PaddedRows) -> bool:
    """Whether the native kernel takes a piece's (codes, scales) of both moments as they are."""
    return native.takes(*coded) and _kernel_sizes_fit(coded, blocks)


def _kernel_sizes_fit(coded: tuple[torch.Tensor, ...] | list[torch.Tensor], blocks: PaddedRows) -> bool:
    """Whether a piece's (codes, scales) of both moments have the sizes and scale dtype
    the kernels (native and Triton) write in place."""
    m_codes, m_absmax, v_codes, v_absmax = coded
    return (m_codes.numel() == v_codes.numel() == blocks.numel and m_absmax.numel() == v_absmax.numel() == blocks.rows
            and m_absmax.dtype == v_absmax.dtype == torch.float32)


class _Group(ctypes.Structure):
    """A param group's hyper-parameters for the batched kernels (native_kernels.c,
    `adam8bit_group`), which derive a step's scalars from them as `_Hyper` does."""

    _fields_ = [(name, ctypes.c_double) for name in ("lr", "beta1", "beta2", "eps", "weight_decay")]

    @classmethod
    def of(cls, group: dict) -> "_Group":
        beta1, beta2 = group["betas"]
        return cls(group["lr"], beta1, beta2, group["eps"], group["weight_decay"])


class _CodedDescriptor(ctypes.Structure):
    """A coded piece for the batched kernel (native_kernels.c, `adam8bit_coded_piece`)."""

    _fields_ = [(name, ctypes.c_void_p) for name in ("param", "grad", "step", "m_codes", "m_absmax", "v_codes",
                                                     "v_absmax", "edges")]
    _fields_ += [("n", ctypes.c_int64), ("offset", ctypes.c_int64), ("group", _Group)]


class _Fp32Descriptor(ctypes.Structure):
    """A small piece with fp32 moments for the batched kernels (native_kernels.c,
    `adam8bit_fp32_piece`)."""

    _fields_ = [(name, ctypes.c_void_p) for name in ("param", "grad", "step", "exp_avg", "exp_avg_sq", "root")]
    _fields_ += [("n", ctypes.c_int64), ("group", _Group)]


class _Piece(abc.ABC):
    """A tensor in its steady state, stepped with the others by the batched kernels: its
    state's tensors and its kernel descriptor are kept from step to step, so a step only
    refreshes the descriptor's pointers and group. The kernels advance `state["step"]`
    themselves (a CPU fp32 tensor, as checkpoints hold it). `current` says whether the
    state is still the one it was made from: a loaded or replaced state, or one that
    changed form, makes the tensor step alone again."""

    keys: tuple[str, ...]  # the state entries the descriptor points at

    def __init__(self, state: dict, full_numel: int):
        self.state = state
        self.step = state["step"]
        self.tensors = tuple(state[key] for key in self.keys)
        self.full_numel = full_numel
        self.descriptor = self.describe()
        self.addresses = self._addresses()

    @staticmethod
    def takes_state(state: dict, keys: tuple[str, ...]) -> bool:
        """Whether the kernels can keep the step count and these entries where they are."""
        step = state.get("step")
        return (torch.is_tensor(step) and step.dtype == torch.float32 and step.numel() == 1 and native.takes(step)
                and all(torch.is_tensor(state.get(key)) for key in keys))

    @abc.abstractmethod
    def describe(self) -> ctypes.Structure:
        """The kernel's descriptor of the piece, but for the tensor, its gradient and group."""

    @abc.abstractmethod
    def fits(self, min_8bit_size: int) -> bool:
        """Whether the piece still takes this kind of step."""

    def _addresses(self) -> tuple[int, ...]:
        return tuple(tensor.data_ptr() for tensor in (self.step, *self.tensors))

    def current(self, param: torch.Tensor, state: dict, min_8bit_size: int) -> bool:
        """The descriptor still describes the state: the same tensors, at the same addresses
        (a storage moved and back, `engine.offload_states()`, keeps its tensors but not
        its address)."""
        return (state is self.state and state.get("step") is self.step
                and all(map(operator.is_, map(state.get, self.keys), self.tensors))
                and self._addresses() == self.addresses
                and self.fits(min_8bit_size) and _on_cpu_in_fp32(param))

    def refresh(self, param: torch.Tensor, group: _Group) -> ctypes.Structure:
        descriptor = self.descriptor
        descriptor.param, descriptor.grad, descriptor.group = param.data_ptr(), param.grad.data_ptr(), group
        return descriptor


class _CodedPiece(_Piece):
    """A piece in 8 bits; its cut blocks' fp32 rows are written to `edges` each step."""

    keys = CODED_KEYS

    def __init__(self, state: dict, shard: ParameterShard, cut: list[_CutBlock]):
        self.blocks = PaddedRows.of(shard, BLOCK)
        self.cut = cut
        self.edges = torch.zeros(len(MOMENTS), 2, BLOCK) if cut else None
        super().__init__(state, shard.full_numel)

    def describe(self) -> _CodedDescriptor:
        return _CodedDescriptor(None, None, self.step.data_ptr(), *(t.data_ptr() for t in self.tensors),
                                native.pointer(self.edges), self.blocks.numel, self.blocks.offset)

    def fits(self, min_8bit_size: int) -> bool:
        return self.full_numel >= min_8bit_size and MOMENTS[0][0] not in self.state

    def cut_values(self) -> list[_CutValues]:
        return [_CutValues(self.state, k, block, self.edges[k, block.edge])
                for k in range(len(MOMENTS)) for block in self.cut]


class _Fp32Piece(_Piece):
    """A small parameter's piece (fewer than `min_8bit_size` elements), moments in fp32;
    `root` holds the square roots torch takes between the kernels' two passes."""

    keys = tuple(key for key, _ in MOMENTS)

    def __init__(self, state: dict, shard: ParameterShard):
        self.root = torch.empty(shard.numel)
        super().__init__(state, shard.full_numel)

    @classmethod
    def of(cls, state: dict, shard: ParameterShard) -> _Fp32Piece | None:
        """The piece where its state holds fp32 moments the kernels take."""
        if CODED_KEYS[0] in state or not cls.takes_state(state, cls.keys) or not all(
                state[key].dtype == torch.float32 and state[key].numel() == shard.numel and native.takes(state[key])
                for key in cls.keys):
            return None
        return cls(state, shard)

    def describe(self) -> _Fp32Descriptor:
        return _Fp32Descriptor(None, None, self.step.data_ptr(), *(t.data_ptr() for t in self.tensors),
                               self.root.data_ptr(), self.root.numel())

    def fits(self, min_8bit_size: int) -> bool:
        return self.full_numel < min_8bit_size and CODED_KEYS[0] not in self.state


def _step_batched(coded: list[_CodedDescriptor], small: list[_Fp32Piece]) -> None:
    """One native call for the coded pieces; two for the small ones, around torch's
    square roots of their second moments (`_adam_step`'s, tensor by tensor)."""
    kernels = native.library()
    if coded:
        kernels.adam8bit_steps((_CodedDescriptor * len(coded))(*coded), len(coded), *_native_books(),
                               native.threads())
    if small:
        descriptors = (_Fp32Descriptor * len(small))(*(piece.descriptor for piece in small))
        kernels.adam8bit_fp32_moments(descriptors, len(small))
        torch._foreach_sqrt_([piece.root for piece in small])
        kernels.adam8bit_fp32_apply(descriptors, len(small))


class _CutBlock(NamedTuple):
    """A block of a piece cut by a piece boundary: its slot in the shard group's table,
    its row among the piece's padded rows, which of the piece's two edge rows holds it (0:
    the first), and where the piece's elements of it lie, in the piece and in the row."""

    slot: int
    row: int
    edge: int
    in_piece: slice
    in_row: slice

    @classmethod
    def of(cls, shard: ParameterShard, block: int, slot: int) -> "_CutBlock":
        blocks = PaddedRows.of(shard, BLOCK)
        row = block - blocks.first_row
        first = max(row * BLOCK, blocks.offset)
        last = min((row + 1) * BLOCK, blocks.offset + blocks.numel)
        return cls(slot, row, 0 if row == 0 else 1, slice(first - blocks.offset, last - blocks.offset),
                   slice(first - row * BLOCK, last - row * BLOCK))


class _CutValues(NamedTuple):
    """One moment's values in a cut block (its padded row), quantised for now with this
    rank's partial absmax, to be quantised again once the block's true absmax is known."""

    state: dict
    k: int
    block: _CutBlock
    values: torch.Tensor

    def requantise(self, absmax: torch.Tensor) -> None:
        key, signed = MOMENTS[self.k]
        absmax = absmax.reshape(1).to(self.values.device)
        codes = quantize(self.values.unsqueeze(0), absmax, codebook(signed).to(absmax.device))[0]
        self.state[f"{key}_codes"][self.block.in_piece] = codes[self.block.in_row]
        self.state[f"{key}_absmax"][self.block.row] = absmax[0]


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


_BOOKS_BUILT = threading.Lock()


def _native_books() -> tuple[int, int, int, int]:
    """The kernels' codebook arguments: the addresses of `_native_codebook`'s tables, kept
    alive by its cache. Built under a lock: threads stepping at once (ranks as threads,
    tests/runtime/optim/pieces.py) would each build the tables on a cache miss, the cache
    keep one thread's, and the other hand the kernels the addresses of tables since freed
    (NaN and 1e36 weights in the first step of a fresh process)."""
    with _BOOKS_BUILT:
        return _native_book_addresses()


@functools.cache
def _native_book_addresses() -> tuple[int, int, int, int]:
    return tuple(table.data_ptr() for signed in (True, False) for table in _native_codebook(signed))


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
