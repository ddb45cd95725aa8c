"""Where a tensor-parallel rank's local parameter sits in the full one.

Every sharded parameter carries a `TensorShard` (attribute `_shardwise_tensor_shard`): the
global shape, the dimension it is split along, the lengths of the fused parts along it, and
the global index ranges along that dimension that this rank holds, in the order they are
concatenated locally. A fused projection (GPT's qkv, GPT-2's c_attn) is split per part, so
rank r holds three ranges (its heads of q, of k and of v), not one: splitting the fused
matrix in two halves would give rank 0 all of q and half of k. The parts need not be equal:
Phi-3's qkv_proj with grouped key/value heads is q (heads x head_dim rows), then k and v
(kv_heads x head_dim rows each).

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
    parts: tuple[int, ...]  # lengths of the fused parts along `dim` (one part: the whole dimension)

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


def fused_parts(length: int, blocks: int | tuple[int, ...]) -> tuple[int, ...]:
    """The lengths of the fused parts of a dimension of `length`: `blocks` equal ones, or
    the lengths given (which must add up to it)."""
    if isinstance(blocks, int):
        return (length // blocks,) * blocks
    if sum(blocks) != length:
        raise ValueError(f"fused parts of lengths {blocks} (sum {sum(blocks)}) do not make up a dimension of {length}")
    return tuple(blocks)


def split_ranges(length: int, blocks: int | tuple[int, ...], rank: int, size: int) -> tuple[tuple[int, int], ...]:
    """Rank `rank`'s ranges of a dimension of `length` made of fused parts (`blocks` equal
    ones, or of the lengths given), each split in `size` equal chunks."""
    ranges, start = [], 0
    for part in fused_parts(length, blocks):
        if part % size:
            raise ValueError(f"a fused part of length {part} does not split over {size} tensor-parallel ranks")
        chunk = part // size
        ranges.append((start + rank * chunk, start + (rank + 1) * chunk))
        start += part
    return tuple(ranges)


def take(tensor: torch.Tensor, dim: int, ranges: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """The local block of a full tensor (a copy, so the full one can be freed)."""
    pieces = [tensor.narrow(dim, start, stop - start) for start, stop in ranges]
    return torch.cat(pieces, dim).clone() if len(pieces) > 1 else pieces[0].clone()


def shard_parameter(param: nn.Parameter, dim: int, blocks: int | tuple[int, ...], rank: int,
                    size: int) -> nn.Parameter:
    """Keep only this rank's block of `param` along `dim`, in place: the parameter object
    stays the same, so an optimizer built over the full model still holds it, and a
    parameter tied between modules stays tied."""
    global_shape = tuple(param.shape)
    parts = fused_parts(global_shape[dim], blocks)
    ranges = split_ranges(global_shape[dim], parts, rank, size)
    param.data = take(param.data, dim, ranges)
    setattr(param, ATTRIBUTE, TensorShard(global_shape, dim, ranges, parts))
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
    for rank in range(comm.size):
        position = 0
        for start, stop in split_ranges(shard.global_shape[shard.dim], shard.parts, rank, comm.size):
            piece = gathered[rank].narrow(shard.dim, position, stop - start)
            full.narrow(shard.dim, start, stop - start).copy_(piece)
            position += stop - start
    return full
