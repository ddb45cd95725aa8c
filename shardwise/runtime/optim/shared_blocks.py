"""Quantisation blocks that a ZeRO piece boundary cuts, and their scales.

A block's scale is the absolute maximum over all its elements. When a piece boundary
falls inside a block, the elements are on two (or more) ranks, and each knows only its
part. The maximum is made exact with the sum that the shard group offers: every rank
writes the absolute values it holds of a cut block at their positions inside a zero row
of BLOCK entries, the rows are summed (each position has one nonzero writer, so the sum
is the values themselves, bit for bit) and the maximum is taken of the result.

Which blocks are cut must be known identically on every rank (each rank's row of the sum
sits at the same place), so it is found once, by a sum of "touches this block partly"
marks over every parameter's blocks.
"""

from __future__ import annotations

import math

import torch

from shardwise.runtime.optim.quantization import BLOCK
from shardwise.runtime.optim.sharded import ParameterShard, ShardAwareOptimizer


def partial_blocks(shard: ParameterShard) -> list[int]:
    """Blocks (parameter coordinates) the piece touches without covering them whole."""
    if shard.numel == 0:
        return []
    touched = {shard.start // BLOCK, (shard.stop - 1) // BLOCK}
    return sorted(
        block for block in touched
        if shard.start > block * BLOCK or shard.stop < min((block + 1) * BLOCK, shard.full_numel)
    )


class SharedBlocks:
    """Cut blocks numbered alike on every rank: `slot(index, block)` or None if whole."""

    def __init__(self, slots: dict[tuple[int, int], int]):
        self._slots = slots

    @classmethod
    def discover(
        cls, optimizer: ShardAwareOptimizer, shapes: list[tuple[int, ...] | None], quantised: list[torch.Tensor]
    ) -> "SharedBlocks":
        """Every rank of the shard group calls this at once; `shapes` from
        layout.parameter_shapes, `quantised` the tensors this rank keeps in 8 bits."""
        counts = [0 if shape is None else math.ceil(math.prod(shape) / BLOCK) for shape in shapes]
        offsets = [0]
        for count in counts:
            offsets.append(offsets[-1] + count)
        marks = torch.zeros(offsets[-1], dtype=torch.float32)
        for tensor in quantised:
            shard = optimizer.shard_of(tensor)
            for block in partial_blocks(shard):
                marks[offsets[shard.index] + block] = 1.0
        optimizer.sum_over_shards(marks)
        cut = torch.nonzero(marks).flatten()
        owners = torch.searchsorted(torch.tensor(offsets[1:]), cut, right=True).tolist()
        slots = {(index, position - offsets[index]): slot
                 for slot, (index, position) in enumerate(zip(owners, cut.tolist()))}
        return cls(slots)

    def __len__(self) -> int:
        return len(self._slots)

    def slot(self, index: int, block: int) -> int | None:
        return self._slots.get((index, block))

    def maxima(self, optimizer: ShardAwareOptimizer, rows: list[tuple[int, int, torch.Tensor]], states: int,
               device: torch.device) -> torch.Tensor:
        """rows: (slot, state k < states, this rank's padded row of the block for state k).
        Returns the (slots, states) absolute maxima over whole blocks; every rank of the
        shard group must call it, with the same `states`."""
        table = torch.zeros(len(self), states, BLOCK, dtype=torch.float32, device=device)
        for slot, k, row in rows:
            table[slot, k] = row.abs()
        if len(self):
            optimizer.sum_over_shards(table)
        return table.amax(dim=2)
