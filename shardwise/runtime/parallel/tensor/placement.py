"""Where a tensor-parallel rank's local parameter sits in the full one.

Every sharded parameter carries a `TensorShard` (attribute `_shardwise_tensor_shard`): the
global shape, the dimension it is split along, and the global index ranges along that
dimension that this rank holds, in the order they are concatenated locally. A fused
projection (GPT's qkv, GPT-2's c_attn) is split per block, so rank r holds three ranges
(its heads of q, of k and of v), not one: splitting the fused matrix in two halves would
give rank 0 all of q and half of k.

Parameters without the attribute are replicated over the tensor group: identical on every
tensor rank, so a global quantity (the gradient norm) counts them once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from shardwise.runtime.distributed.collectives import Communicator

ATTRIBUTE = "_shardwise_tensor_shard"


@dataclass(frozen=True)
class TensorShard:
    global_shape: tuple[int, ...]
    dim: int
    ranges: tuple[tuple[int, int], ...]  # global [start, stop) along `dim`, concatenated locally

    @property
    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.global_shape)
        shape[self.dim] = sum(stop - start for start, stop in self.ranges)
        return tuple(shape)

    def global_runs(self, start: int, stop: int) -> list[tuple[int, int, int]]:
        """Local flat elements [start, stop) as runs of consecutive global flat indices:
        (global start, global stop, position in [start, stop)).

        The dimensions after `dim` are whole, so one local index along `dim` and every
        following one inside the same range are consecutive globally; a run ends at the
        end of a range (fused q/k/v: rank r's q heads are not next to its k heads) or of
        the dimensions before `dim` (a row-parallel weight: one run per row)."""
        inner = math.prod(self.global_shape[self.dim + 1 :])
        local_extent = self.local_shape[self.dim] * inner
        global_extent = self.global_shape[self.dim] * inner
        bounds, position = [], 0  # local [begin, end) along `dim` of each range, in local order
        for low, high in self.ranges:
            bounds.append((position, position + high - low, low))
            position += high - low
        runs, position = [], start
        while position < stop:
            outer, rest = divmod(position, local_extent)
            local_index = rest // inner
            begin, end, global_low = next(b for b in bounds if b[0] <= local_index < b[1])
            run_stop = min(stop, outer * local_extent + end * inner)
            first = outer * global_extent + (global_low - begin) * inner + rest
            runs.append((first, first + run_stop - position, position - start))
            position = run_stop
        return runs


def split_ranges(length: int, blocks: int, rank: int, size: int) -> tuple[tuple[int, int], ...]:
    """Rank `rank`'s ranges of a dimension of `length` made of `blocks` equal fused blocks,
    each split in `size` equal chunks."""
    block = length // blocks
    chunk = block // size
    return tuple((b * block + rank * chunk, b * block + (rank + 1) * chunk) for b in range(blocks))


def take(tensor: torch.Tensor, dim: int, ranges: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """The local block of a full tensor (a copy, so the full one can be freed)."""
    pieces = [tensor.narrow(dim, start, stop - start) for start, stop in ranges]
    return torch.cat(pieces, dim).clone() if len(pieces) > 1 else pieces[0].clone()


def shard_parameter(param: nn.Parameter, dim: int, blocks: int, rank: int, size: int) -> nn.Parameter:
    """Keep only this rank's block of `param` along `dim`, in place: the parameter object
    stays the same, so an optimizer built over the full model still holds it, and a
    parameter tied between modules stays tied."""
    global_shape = tuple(param.shape)
    ranges = split_ranges(global_shape[dim], blocks, rank, size)
    param.data = take(param.data, dim, ranges)
    setattr(param, ATTRIBUTE, TensorShard(global_shape, dim, ranges))
    return param


def tensor_shard(param: torch.Tensor) -> TensorShard | None:
    return getattr(param, ATTRIBUTE, None)


def is_tensor_sharded(param: torch.Tensor) -> bool:
    return hasattr(param, ATTRIBUTE)


def gather_full(local: torch.Tensor, shard: TensorShard | None, comm: Communicator) -> torch.Tensor:
    """The full tensor from every tensor rank's local block (collective over `comm`):
    for comparisons with a single-process model, and for exporting full weights."""
    if shard is None or comm.size == 1:
        return local.detach().clone()
    blocks = local.detach().contiguous()
    gathered = blocks.new_empty((comm.size, *blocks.shape))
    comm.all_gather(gathered.view(-1), blocks.view(-1), "tensor-parallel shards of a parameter").wait()
    full = blocks.new_empty(shard.global_shape)
    blocks_per_rank = len(shard.ranges)
    for rank in range(comm.size):
        position = 0
        for start, stop in split_ranges(shard.global_shape[shard.dim], blocks_per_rank, rank, comm.size):
            piece = gathered[rank].narrow(shard.dim, position, stop - start)
            full.narrow(shard.dim, start, stop - start).copy_(piece)
            position += stop - start
    return full
