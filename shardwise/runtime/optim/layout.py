"""What a shard-aware optimizer must know beyond the pieces it holds.

A collective is only correct when every rank of the shard group calls it with a tensor of
the same length. Row and column statistics, quantisation blocks shared across pieces and
whole matrices assembled from pieces are laid out per parameter, so every rank needs the
shape of every parameter, including those of which it holds nothing (ZeRO hands a rank
only its own pieces). `parameter_shapes` learns them once, with one small sum over the
shard group.

The rest is piece geometry: a piece is elements [start, stop) of a flattened parameter,
and row-wise statistics (a matrix's rows, a quantisation block) are computed on the piece
copied into a zero buffer of whole rows, so a row cut by a piece boundary gets this
rank's partial contribution and the zeros add nothing.
"""

from __future__ import annotations

from typing import Iterator

import torch

from shardwise.runtime.optim.sharded import ParameterShard, ShardAwareOptimizer

MAX_DIMS = 8  # parameter dimensions the shape exchange carries


def parameter_shapes(optimizer: ShardAwareOptimizer) -> list[tuple[int, ...] | None]:
    """The shape of every parameter, by `ParameterShard.index`, identical on every rank
    (None for an index no rank trains). Every rank of the shard group must call it."""
    table = torch.zeros(optimizer.parameter_count, 2 + MAX_DIMS, dtype=torch.float64)
    for group in optimizer.param_groups:
        for param in group["params"]:
            shard = optimizer.shard_of(param)
            if len(shard.shape) > MAX_DIMS:
                raise ValueError(f"parameter {shard.name or shard.index} has {len(shard.shape)} dimensions; "
                                 f"shard-aware optimizers handle at most {MAX_DIMS}")
            table[shard.index, 0] = 1.0
            table[shard.index, 1] = len(shard.shape)
            table[shard.index, 2 : 2 + len(shard.shape)] = torch.tensor(shard.shape, dtype=torch.float64)
    optimizer.sum_over_shards(table)
    shapes: list[tuple[int, ...] | None] = []
    for holders, ndim, *dims in table.tolist():
        if holders == 0:
            shapes.append(None)
            continue
        shapes.append(tuple(round(size / holders) for size in dims[: round(ndim / holders)]))
    return shapes


def params_with_grad(optimizer: torch.optim.Optimizer) -> Iterator[tuple[torch.Tensor, dict]]:
    """(trained tensor, its param group) for every tensor that has a gradient this step."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is not None:
                yield param, group


def flat(tensor: torch.Tensor) -> torch.Tensor:
    """The piece as the 1-D run of elements it is, as a view (updates written through it
    reach the tensor): without ZeRO a whole parameter keeps its shape, and the geometry
    works on its flattened elements."""
    if not tensor.is_contiguous():
        raise ValueError(f"shard-aware optimizers need contiguous parameters; got one of shape "
                         f"{tuple(tensor.shape)} with strides {tensor.stride()}")
    return tensor.view(-1)


class PaddedRows:
    """Elements [start, start + numel) of a flattened tensor whose rows have `width`
    elements, placed in a zero buffer of the whole rows they touch."""

    def __init__(self, start: int, numel: int, width: int):
        self.start, self.numel, self.width = start, numel, width
        self.first_row = start // width
        self.offset = start - self.first_row * width
        self.rows = -(-(self.offset + numel) // width) if numel else 0  # integer ceil: traceable

    @classmethod
    def of(cls, shard: ParameterShard, width: int) -> "PaddedRows":
        return cls(shard.start, shard.numel, width)

    @property
    def whole(self) -> bool:
        """The piece is whole rows: padding adds nothing."""
        return self.offset == 0 and self.numel == self.rows * self.width

    def pad(self, values: torch.Tensor) -> torch.Tensor:
        """`values` (the piece, flattened) in its rows: a (rows, width) tensor, zeros
        elsewhere; a view of `values` when the piece is whole rows (not to be written)."""
        if self.whole:
            return flat(values).view(self.rows, self.width)
        buffer = values.new_zeros(self.rows * self.width)
        buffer[self.offset : self.offset + self.numel] = flat(values)
        return buffer.view(self.rows, self.width)

    def unpad(self, rows: torch.Tensor) -> torch.Tensor:
        """The piece's own elements of a (rows, width) tensor, flattened."""
        return rows.reshape(-1)[self.offset : self.offset + self.numel]
