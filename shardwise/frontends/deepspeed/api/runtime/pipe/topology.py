"""`deepspeed.runtime.pipe.topology`: DeepSpeed's description of a job's process grid, which
Megatron-DeepSpeed and other model code build to find their groups.

A `ProcessTopology` lays ranks out on named axes in row-major order (the last axis
varies fastest): with axes ["pipe", "data"] and dims [2, 2], ranks 0 and 1 are pipeline
stage 0. It answers pure questions about that layout. `PipelineParallelGrid` creates the
process groups of a topology over the running job (one group per line along each axis,
created by every rank in the same order, as torch.distributed requires) and tells each
rank its stage, its data-parallel index and its groups.

shardwise's own engine builds its mesh from the config's parallel sizes; these classes are
for code that computes with DeepSpeed's topology itself (`PipelineModule(topology=...)`
is refused: give `num_stages`).
"""

from __future__ import annotations

from collections import namedtuple
from itertools import product
from typing import Any

import torch.distributed as dist

from shardwise.runtime.distributed.setup import collective_timeout

__all__ = ["PipeDataParallelTopology", "PipeModelDataParallelTopology", "PipelineParallelGrid", "ProcessTopology"]


class ProcessTopology:
    def __init__(self, axes: list[str], dims: list[int]):
        if len(axes) != len(dims):
            raise ValueError(f"ProcessTopology: {len(axes)} axes {axes} but {len(dims)} dims {dims}")
        self.axes = list(axes)
        self.dims = list(dims)
        self.ProcessCoord = namedtuple("ProcessCoord", self.axes)
        self.mapping = {self.ProcessCoord(*coord): rank
                        for rank, coord in enumerate(product(*(range(dim) for dim in self.dims)))}

    def get_rank(self, **coord_kwargs: int) -> int:
        """The rank at a full coordinate, e.g. `get_rank(pipe=1, data=0)`."""
        if sorted(coord_kwargs) != sorted(self.axes):
            raise ValueError(f"get_rank() needs a value for each axis {self.axes}, got {sorted(coord_kwargs)}")
        key = self.ProcessCoord(**coord_kwargs)
        if key not in self.mapping:
            raise ValueError(f"coordinate {key} is outside the topology's dims {self.dims}")
        return self.mapping[key]

    def get_axis_names(self) -> list[str]:
        return list(self.axes)

    def get_rank_repr(self, rank: int, omit_axes: list[str] = ("data", "pipe"), inner_sep: str = "_",
                      outer_sep: str = "-") -> str:
        """A name for `rank` from its coordinates, e.g. "model_01" (checkpoint file names)."""
        coord = self.get_coord(rank)
        return outer_sep.join(f"{axis}{inner_sep}{getattr(coord, axis):02d}"
                              for axis in self.axes if axis not in omit_axes)

    def get_dim(self, axis: str) -> int:
        """The size of `axis` (0 for an axis the topology lacks)."""
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def get_coord(self, rank: int) -> Any:
        for coord, owner in self.mapping.items():
            if owner == rank:
                return coord
        raise ValueError(f"rank {rank} is not in a topology of {self.world_size()} ranks")

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """The ranks of every line along `axis` (each a group for that axis's collectives);
        [] for an axis the topology lacks."""
        if axis not in self.axes:
            return []
        others = [name for name in self.axes if name != axis]
        lists = []
        for fixed in product(*(range(self.get_dim(name)) for name in others)):
            where = dict(zip(others, fixed))
            lists.append([self.get_rank(**where, **{axis: index}) for index in range(self.get_dim(axis))])
        return lists

    def filter_match(self, **filter_kwargs: int) -> list[int]:
        """The ranks whose coordinates match every given axis value."""
        return [rank for coord, rank in self.mapping.items()
                if all(getattr(coord, axis) == value for axis, value in filter_kwargs.items())]

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """The ranks at index `idx` of `axis`."""
        return self.filter_match(**{axis: idx})

    def world_size(self) -> int:
        return len(self.mapping)

    def __str__(self) -> str:
        return str(self.mapping)


def _prime_factors(number: int) -> list[int]:
    """The prime factors of a positive integer, smallest first (with repeats)."""
    if number <= 0:
        raise ValueError(f"prime factors of {number}: need a positive integer")
    factors, divisor = [], 2
    while number > 1:
        while number % divisor == 0:
            factors.append(divisor)
            number //= divisor
        divisor += 1
    return factors


def _product(numbers: list[int]) -> int:
    result = 1
    for number in numbers:
        result *= number
    return result


class PipeDataParallelTopology(ProcessTopology):
    """Pipeline stages outermost, data parallelism inside (neighbouring ranks share a stage)."""

    def __init__(self, num_pp: int, num_dp: int):
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """3D: pipeline outermost, then data, then model (tensor) parallelism innermost."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int):
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])


class PipelineParallelGrid:
    """A topology's process groups in the running job, and this rank's place in them."""

    def __init__(self, topology: ProcessTopology | None = None, process_group: Any = None):
        self.global_rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        if topology is None:
            # DeepSpeed's default: the world's prime factors dealt alternately to pipeline and data
            factors = _prime_factors(self.world_size)
            stages = _product(factors[0::2])
            topology = PipeDataParallelTopology(num_pp=stages, num_dp=self.world_size // stages)
        if topology.world_size() != self.world_size:
            raise ValueError(f"PipelineParallelGrid: the topology has {topology.world_size()} ranks, the job "
                             f"{self.world_size}")
        self._topo = topology
        self.data_parallel_size = max(topology.get_dim("data"), 1)
        self.pipe_parallel_size = max(topology.get_dim("pipe"), 1)
        self.model_parallel_size = max(topology.get_dim("model"), 1)
        self.slice_parallel_size = self.model_parallel_size
        coord = topology.get_coord(self.global_rank)
        self.stage_id = getattr(coord, "pipe", 0)
        self.data_parallel_id = getattr(coord, "data", 0)
        self.is_first_stage = self.stage_id == 0
        self.is_last_stage = self.stage_id == self.pipe_parallel_size - 1
        self.dp_group, self.dp_proc_group = self._my_group("data")
        self.pp_group, self.pp_proc_group = self._my_group("pipe")
        self.slice_group, self.slice_proc_group = self._my_group("model")
        self.ds_model_proc_group = self._model_replica_group()
        self.p2p_groups = self._pipe_neighbours()

    def _my_group(self, axis: str) -> tuple[list[int], Any]:
        """(ranks, process group) of this rank's line along `axis`; every line's group is
        created on every rank, in the same order, as new_group requires."""
        mine, handle = [self.global_rank], None
        lists = self._topo.get_axis_comm_lists(axis) or [[rank] for rank in range(self.world_size)]
        for ranks in lists:
            group = dist.new_group(ranks=ranks, timeout=collective_timeout())
            if self.global_rank in ranks:
                mine, handle = ranks, group
        return mine, handle

    def _model_replica_group(self) -> Any:
        """The ranks holding one copy of the model (all stages and model-parallel ranks at one data index)."""
        handle = None
        for data in range(self.data_parallel_size):
            ranks = self._topo.filter_match(data=data) if "data" in self._topo.axes else list(range(self.world_size))
            group = dist.new_group(ranks=ranks, timeout=collective_timeout())
            if self.global_rank in ranks:
                handle = group
        return handle

    def _pipe_neighbours(self) -> list[list[int]]:
        """[stage i, stage i + 1] rank pairs along each pipeline line (the last wraps to the first)."""
        pairs = []
        for line in self._topo.get_axis_comm_lists("pipe"):
            pairs += [[line[index], line[(index + 1) % len(line)]] for index in range(len(line))]
        return pairs

    def _is_grid_valid(self) -> bool:
        """Whether the topology's axes multiply to the world size."""
        return _product([self._topo.get_dim(axis) for axis in self._topo.get_axis_names()]) == dist.get_world_size()

    def get_stage_id(self) -> int:
        return self.stage_id

    def get_data_parallel_id(self) -> int:
        return self.data_parallel_id

    def stage_to_global(self, stage_id: int, **kwargs: int) -> int:
        """The global rank of `stage_id` at this rank's other coordinates (overridden by kwargs)."""
        coord = self._topo.get_coord(self.global_rank)._asdict()
        coord.update(pipe=stage_id, **kwargs)
        return self._topo.get_rank(**coord)

    def topology(self) -> ProcessTopology:
        return self._topo

    def get_global_rank(self) -> int:
        return self.global_rank

    def get_pipe_parallel_rank(self) -> int:
        return self.stage_id

    def get_pipe_parallel_world_size(self) -> int:
        return self.pipe_parallel_size

    def get_pipe_parallel_group(self) -> Any:
        return self.pp_proc_group

    def get_data_parallel_rank(self) -> int:
        return self.data_parallel_id

    def get_data_parallel_world_size(self) -> int:
        return self.data_parallel_size

    def get_data_parallel_group(self) -> Any:
        return self.dp_proc_group

    def get_model_parallel_rank(self) -> int:
        return getattr(self._topo.get_coord(self.global_rank), "model", 0)

    def get_model_parallel_world_size(self) -> int:
        return self.model_parallel_size

    def get_model_parallel_group(self) -> Any:
        return self.slice_proc_group

    def get_slice_parallel_rank(self) -> int:
        return self.get_model_parallel_rank()

    def get_slice_parallel_world_size(self) -> int:
        return self.slice_parallel_size

    def get_slice_parallel_group(self) -> Any:
        return self.slice_proc_group
