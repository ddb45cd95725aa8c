"""Optimizers whose update depends on whole parameters, written so they also run on pieces.

LAMB's and LARS's trust ratios need the norm of a whole weight; Adafactor needs a matrix's
row and column statistics; block-wise quantised state needs block boundaries in the
parameter's own coordinates. Under ZeRO a rank owns arbitrary element ranges of a
parameter, so such an optimizer is told, for each tensor it trains, which piece of which
parameter it is (`ParameterShard`), and is given a function that sums partial statistics
over the ranks holding the other pieces (the ZeRO shard group).

Used on an ordinary model (no ZeRO), every parameter is its own whole shard and the sum
is the identity: the same class, the same arithmetic, which is what lets a test compare a
partitioned run with a single-process one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class ParameterShard:
    """Elements [start, stop) of the flattened parameter `name` of shape `shape`;
    `index` numbers the parameter the same way on every rank (0 .. count-1)."""

    name: str
    shape: tuple[int, ...]
    start: int
    stop: int
    index: int

    @property
    def numel(self) -> int:
        return self.stop - self.start

    @property
    def full_numel(self) -> int:
        return math.prod(self.shape)


SumOverShards = Callable[[torch.Tensor], torch.Tensor]


class ShardAwareOptimizer(torch.optim.Optimizer):
    """Base class: `shard_of(p)` and `sum_over_shards(t)` work with or without ZeRO."""

    def attach_shards(
        self,
        shards: dict[torch.Tensor, ParameterShard],
        count: int,
        sum_over_shards: SumOverShards,
        sum_data_over_shards: SumOverShards | None = None,
    ) -> None:
        """Called by ZeRO: what each trained tensor is a piece of, how many parameters the
        model has (the length of per-parameter statistics), and how to sum them.

        `sum_over_shards` is for small statistics (counted as control traffic);
        `sum_data_over_shards`, where given, for parameter-sized tensors (an optimizer
        assembling whole matrices from their pieces), counted as data traffic. Without it the small one serves."""
        self._shards = {id(tensor): shard for tensor, shard in shards.items()}
        self._count = count
        self._sum = sum_over_shards
        self._sum_data = sum_data_over_shards or sum_over_shards

    @property
    def parameter_count(self) -> int:
        if hasattr(self, "_count"):
            return self._count
        return sum(len(group["params"]) for group in self.param_groups)

    def shard_of(self, param: torch.Tensor) -> ParameterShard:
        shards = getattr(self, "_shards", None)
        if shards is None:  # no ZeRO: every parameter is whole, numbered in group order
            params = [p for group in self.param_groups for p in group["params"]]
            shards = {id(p): ParameterShard("", tuple(p.shape), 0, p.numel(), i) for i, p in enumerate(params)}
            self._shards = shards
        return shards[id(param)]

    def sum_over_shards(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` (in place) over the ranks holding the other pieces of each parameter."""
        reduce = getattr(self, "_sum", None)
        return tensor if reduce is None else reduce(tensor)

    def sum_data_over_shards(self, tensor: torch.Tensor) -> torch.Tensor:
        """As `sum_over_shards`, for tensors as large as a parameter."""
        reduce = getattr(self, "_sum_data", None)
        return tensor if reduce is None else reduce(tensor)

    def parameter_norms(self, *columns: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Whole-parameter L2 norms, several kinds at once: each column lists (param, value)
        pairs; the result's [i, k] is the norm of column k's values over every piece of
        parameter i. One reduction for all parameters and columns."""
        params = [param for param, _ in columns[0]] if columns else []
        if any([param for param, _ in column] != params for column in columns):
            raise ValueError("parameter_norms: every column must list the same parameters in the same order")
        return self.parameter_norms_of_squares(params, piece_squares(*[[v for _, v in c] for c in columns]))

    def parameter_norms_of_squares(self, params: list[torch.Tensor], squares: torch.Tensor) -> torch.Tensor:
        """As `parameter_norms`, from each piece's squared norms ((pieces, kinds), computed
        by the caller, e.g. in the same compiled loop as its update)."""
        device = squares.device if params else torch.device("cpu")
        total = torch.zeros(self.parameter_count, squares.size(1), dtype=torch.float64, device=device)
        if params:
            index = torch.tensor([self.shard_of(param).index for param in params], device=device)
            total.index_add_(0, index, squares.to(torch.float64))
        return self.sum_over_shards(total).sqrt()


def piece_squares(*columns: list[torch.Tensor]) -> torch.Tensor:
    """(pieces, columns) float64 squared L2 norms: one multi-tensor kernel per column in the
    values' dtype (asking it for float64 would copy every tensor first), squared in float64."""
    if not columns or not columns[0]:
        return torch.zeros(0, len(columns), dtype=torch.float64)
    norms = torch.stack([torch.stack(torch._foreach_norm(column)) for column in columns], 1)
    return norms.double().square_()
