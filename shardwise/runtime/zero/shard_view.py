"""What this rank owns, named in the coordinates of the full model: parameter name and
element range, never flat-buffer offsets.

The engine keeps a rank's share as flat chunks of units (layout.py), and the optimizer's
state per segment of a chunk. Neither survives a change of world size, stage or bucket
size; (name, [start, stop) of the parameter) does. Checkpoints save and load by these
ranges; optimizers that need per-parameter structure (trust ratios, factored or quantised
state) compute on them and reduce partial statistics over `group`, the ranks that hold
the other pieces of the same parameter.

A local tensor may itself be a block of a larger global tensor (a tensor-parallel rank's
slice of a weight): `offsets` place it in the global shape, and `global_runs` turns a
local element range into runs of global flat indices. Without tensor parallelism the
local tensor is the global one and a range is a single run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from shardwise.runtime.distributed.mesh import GroupHandle
from shardwise.runtime.zero.layout import FlatUnit
from shardwise.runtime.zero.shard_store import ShardStore, SegmentState


@dataclass(frozen=True)
class OwnedRange:
    """Elements [start, stop) of the flattened local tensor of parameter `name`."""

    name: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]  # where the local tensor starts in the global one, per dimension
    local_shape: tuple[int, ...]
    start: int
    stop: int
    master: torch.Tensor  # the fp32 master values of these elements (a view)
    grad: torch.Tensor  # their reduced gradient (a view)
    segment: SegmentState  # the optimizer segment they sit in
    segment_offset: int  # where `start` sits inside the segment
    group: GroupHandle  # the ranks holding the other pieces of this parameter

    @property
    def numel(self) -> int:
        return self.stop - self.start

    def state_view(self, state: torch.Tensor) -> torch.Tensor:
        """These elements of a per-element optimizer state tensor of the segment."""
        return state[self.segment_offset : self.segment_offset + self.numel]

    def global_runs(self) -> list[tuple[int, int, int]]:
        """(global start, global stop, local position) runs covering [start, stop)."""
        return global_runs(self.global_shape, self.offsets, self.local_shape, self.start, self.stop)


class HeldPiece(NamedTuple):
    """Elements [start, stop) of the flattened local tensor of a parameter held without
    training (no master, no optimizer state): `values` is a view of this rank's shard."""

    name: str
    start: int
    stop: int
    values: torch.Tensor


def global_runs(
    global_shape: tuple[int, ...], offsets: tuple[int, ...], local_shape: tuple[int, ...], start: int, stop: int
) -> list[tuple[int, int, int]]:
    """Map local flat elements [start, stop) of a block at `offsets` inside a tensor of
    `global_shape` to runs of consecutive global flat indices.

    A run is as long as the trailing dimensions in which the block spans the whole global
    extent allow (all of them, when local == global: one run).
    """
    if tuple(local_shape) == tuple(global_shape):
        return [(start, stop, 0)] if stop > start else []
    contiguous = 1  # local elements that are also consecutive globally
    for axis in range(len(local_shape) - 1, -1, -1):
        contiguous *= local_shape[axis]
        if local_shape[axis] != global_shape[axis]:
            break
    strides = [math.prod(global_shape[axis + 1 :]) for axis in range(len(global_shape))]
    runs = []
    position = start
    while position < stop:
        run_end = min(stop, (position // contiguous + 1) * contiguous)
        index, rest = [], position
        for axis in range(len(local_shape) - 1, -1, -1):
            index.append(rest % local_shape[axis])
            rest //= local_shape[axis]
        index.reverse()
        first = sum((offsets[axis] + index[axis]) * strides[axis] for axis in range(len(local_shape)))
        runs.append((first, first + run_end - position, position - start))
        position = run_end
    return runs


def owned_ranges(
    units: list[FlatUnit], store: ShardStore, chunk: int, group: GroupHandle
) -> list[OwnedRange]:
    """Every trained element this rank owns (padding excluded), unit by unit; a piece that
    spans segments (a large parameter cut at sub-group boundaries) gives one range each."""
    segments: dict[int, list[SegmentState]] = {}
    for segment in store.segments:
        segments.setdefault(segment.unit, []).append(segment)
    ranges = []
    for unit in units:
        for piece in unit.owned_pieces(chunk):
            shape = tuple(piece.slot.shape)
            first, last = piece.chunk_offset, piece.chunk_offset + piece.numel
            for segment in (s for s in segments[unit.index] if s.start < last and first < s.stop):
                lo, hi = max(first, segment.start), min(last, segment.stop)
                ranges.append(OwnedRange(
                    piece.slot.name, shape, (0,) * len(shape), shape, piece.start + lo - first,
                    piece.start + hi - first, segment.master[lo - segment.start : hi - segment.start],
                    segment.grad[lo - segment.start : hi - segment.start], segment, lo - segment.start, group,
                ))
    return ranges
