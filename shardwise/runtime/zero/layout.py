"""How parameters are laid out in flat buffers and split across ranks.

Every ZeRO stage shares one layout unit, `FlatUnit`: a run of parameters placed back to
back in a flat buffer, padded so it splits into `num_chunks` equal chunks, chunk r owned
by rank r. In stages 1-2 a unit is a gradient bucket (about `reduce_bucket_size`
elements, filled in backward order); in stage 3 a unit is the parameters one module owns.
Because a unit splits evenly, its gradients reduce with one reduce-scatter and its
parameters rebuild with one all-gather, with no per-parameter bookkeeping on the wire.

A rank's share of the model (`owned_pieces`) is then a list of parameter ranges: the map
that the optimizer (segments by parameter group) and checkpoints (pieces by parameter
name, reshardable to any world size) are built from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

ALIGN_BYTES = 16


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def align_elements(dtype: torch.dtype) -> int:
    """Elements per alignment unit, so every chunk starts on a 16-byte boundary."""
    return max(1, ALIGN_BYTES // torch.empty((), dtype=dtype).element_size())


@dataclass(frozen=True, eq=False)
class ParamSlot:
    """Where one parameter lives inside its unit's flat buffer."""

    name: str
    param: nn.Parameter
    offset: int
    numel: int
    shape: torch.Size
    group: int  # index of the optimizer param group that trains it


@dataclass(frozen=True)
class OwnedPiece:
    """Elements [start, stop) of a flattened parameter that sit in this rank's chunk."""

    slot: ParamSlot
    start: int
    stop: int
    chunk_offset: int  # position of `start` inside the chunk

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Segment:
    """A run of a chunk that belongs to one optimizer param group: [start, stop)."""

    group: int
    start: int
    stop: int


class FlatUnit:
    """Parameters packed into one padded flat buffer that splits into equal chunks."""

    def __init__(self, index: int, slots: list[ParamSlot], num_chunks: int, align: int, label: str):
        self.index = index
        self.slots = slots
        self.num_chunks = num_chunks
        self.label = label
        self.numel = sum(slot.numel for slot in slots)
        self.padded_numel = round_up(max(self.numel, 1), num_chunks * align)
        self.chunk_numel = self.padded_numel // num_chunks

    def __repr__(self) -> str:
        return f"unit {self.index} ({self.label}, {self.numel} elements)"

    def chunk_bounds(self, chunk: int) -> tuple[int, int]:
        start = chunk * self.chunk_numel
        return start, start + self.chunk_numel

    def owned_pieces(self, chunk: int) -> list[OwnedPiece]:
        lo, hi = self.chunk_bounds(chunk)
        pieces = []
        for slot in self.slots:
            start, stop = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            if start < stop:
                pieces.append(OwnedPiece(slot, start - slot.offset, stop - slot.offset, start - lo))
        return pieces

    def segments(self, chunk: int) -> list[Segment]:
        """Runs of one param group covering the whole chunk; padding joins the last run."""
        runs: list[Segment] = []
        for piece in self.owned_pieces(chunk):
            end = piece.chunk_offset + piece.numel
            if runs and runs[-1].group == piece.slot.group:
                runs[-1] = Segment(piece.slot.group, runs[-1].start, end)
            else:
                runs.append(Segment(piece.slot.group, piece.chunk_offset, end))
        if not runs:
            return [Segment(self.slots[-1].group, 0, self.chunk_numel)]
        runs[-1] = Segment(runs[-1].group, runs[-1].start, self.chunk_numel)
        return runs


def pack_units(
    named_params: Iterable[tuple[str, nn.Parameter, int]],
    max_unit_numel: int,
    num_chunks: int,
    align: int,
    first_index: int = 0,
) -> list[FlatUnit]:
    """Greedily pack (name, param, group) in the given order into units of at most
    `max_unit_numel` elements; a parameter larger than that gets a unit of its own."""
    units: list[FlatUnit] = []
    pending: list[tuple[str, nn.Parameter, int]] = []
    pending_numel = 0

    def close() -> None:
        nonlocal pending, pending_numel
        if pending:
            units.append(make_unit(first_index + len(units), pending, num_chunks, align))
        pending, pending_numel = [], 0

    for name, param, group in named_params:
        if pending and pending_numel + param.numel() > max_unit_numel:
            close()
        pending.append((name, param, group))
        pending_numel += param.numel()
    close()
    return units


def make_unit(
    index: int, named_params: list[tuple[str, nn.Parameter, int]], num_chunks: int, align: int,
    label: str | None = None,
) -> FlatUnit:
    slots, offset = [], 0
    for name, param, group in named_params:
        slots.append(ParamSlot(name, param, offset, param.numel(), param.shape, group))
        offset += param.numel()
    if label is None:
        first, last = named_params[0][0], named_params[-1][0]
        label = first if first == last else f"{first} .. {last}"
    return FlatUnit(index, slots, num_chunks, align, label)
