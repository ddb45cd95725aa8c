"""Where DeepSpeed puts each parameter in the flat buffers it partitions, as element ranges.

DeepSpeed's optimizer files hold, per rank and per parameter group, one flat tensor (the
fp32 masters, and one per Adam moment) that is a slice of a concatenation of the group's
parameters. shardwise's checkpoints are keyed by parameter name and element range instead,
so reading and writing DeepSpeed's files is this mapping, in three layouts:

- ZeRO-1/2 and the BF16 optimizer: each group's parameters, in the group's order, back to
  back (with per-parameter alignment padding where `parameter_alignment` asked for it),
  padded at the end to a multiple of 2 x world size, and cut into world-size equal
  partitions; rank r holds elements [r * size, (r + 1) * size) of that concatenation.
- ZeRO-3: every parameter is cut on its own into world-size pieces of ceil(numel / world)
  elements (the last padded); a rank's flat buffer is its piece of each parameter of the
  sub-group, back to back.
- No ZeRO (stage 0): whole parameters.

`Span` is one run of a parameter inside one rank's flat buffer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ALIGNMENT_FACTOR = 2  # DeepSpeed's `nccl_start_alignment_factor`: a group pads to a multiple of 2 x world size


@dataclass(frozen=True)
class Span:
    """Elements [start, stop) of parameter `name`, at `offset` in a rank's flat buffer."""

    name: str
    start: int
    stop: int
    offset: int


def flat_offsets(numels: list[int], paddings: list[int] | None = None) -> tuple[list[int], int]:
    """Each parameter's offset in its group's concatenation, and the concatenation's length
    (before the group's end padding); `paddings[i]` zeros follow parameter i."""
    paddings = paddings or [0] * len(numels)
    offsets, position = [], 0
    for numel, padding in zip(numels, paddings):
        offsets.append(position)
        position += numel + padding
    return offsets, position


def zero12_partition_size(numels: list[int], world_size: int, paddings: list[int] | None = None) -> int:
    """Elements per rank of a ZeRO-1/2 (or BF16 optimizer) group: its concatenation padded to a
    multiple of 2 x world size, divided by the world size."""
    _, total = flat_offsets(numels, paddings)
    alignment = ALIGNMENT_FACTOR * world_size
    return math.ceil(total / alignment) * alignment // world_size


def zero12_spans(names: list[str], numels: list[int], partition_size: int, rank: int,
                 paddings: list[int] | None = None) -> list[Span]:
    """The parameter runs inside rank `rank`'s partition of one group."""
    offsets, _ = flat_offsets(numels, paddings)
    low, high = rank * partition_size, (rank + 1) * partition_size
    spans = []
    for name, numel, offset in zip(names, numels, offsets):
        start, stop = max(low, offset), min(high, offset + numel)
        if start < stop:
            spans.append(Span(name, start - offset, stop - offset, start - low))
    return spans


def zero3_piece(numel: int, world_size: int) -> int:
    """Elements of one parameter each ZeRO-3 rank holds: ceil(numel / world), the last rank padded."""
    return math.ceil(numel / world_size)


def zero3_spans(names: list[str], numels: list[int], world_size: int, rank: int) -> list[Span]:
    """The parameter runs inside rank `rank`'s flat buffer of one ZeRO-3 sub-group."""
    spans, offset = [], 0
    for name, numel in zip(names, numels):
        piece = zero3_piece(numel, world_size)
        start, stop = min(rank * piece, numel), min((rank + 1) * piece, numel)
        if start < stop:
            spans.append(Span(name, start, stop, offset))
        offset += piece
    return spans
