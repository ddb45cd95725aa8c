"""The parallel layout: every rank's place in a five-dimensional grid, and its groups.

Built once from the config and the world size, in one place (as picotron's process-group
manager and torchtitan's `ParallelDims` do), so no other module derives a group itself.
The grid's dimensions, outermost first:

    pipeline  x  data_replicate  x  data_shard  x  sequence  x  tensor

    global rank = (((pipeline * R + replicate) * S + shard) * SP + sequence) * TP + tensor

Tensor parallelism is innermost so a tensor group is a run of consecutive ranks, which
launchers place on one node (its collectives run every layer); the pipeline is outermost
because it only sends activations between neighbours.

Groups are exposed by *purpose*, not only by dimension:

    shard      the ranks ZeRO partitions model states over (data_shard x sequence)
    replicate  ranks holding identical shards (data_replicate); a shard's gradient is
               all-reduced over it. Plain ZeRO 1-3: size 1. Hybrid sharding
               (`mics_shard_size`): world / shard size. Stage 0 is the limit case: shard
               size 1, so every rank replicates everything and gradients are all-reduced.
    replicas   every rank holding the same piece of the model (replicate x shard):
               initial weights are broadcast and gradients averaged over it
    data       data loading: ranks that read different samples (data_replicate x data_shard)
    tensor, sequence, pipeline

Each purpose has a data group (for NCCL, on the device) from torch's `DeviceMesh`, and a
CPU-side gloo *control* group for small agreement collectives, created up front so that
creating a group never happens in the middle of training. `DeviceMesh._flatten` (how
torchtitan names merged dimensions) is private torch API; it is the only one used here.
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from shardwise.runtime.base.torch_compat import mesh_groups_time_out_after

if TYPE_CHECKING:
    from shardwise.runtime.distributed.collectives import CommStats

DIMENSIONS = ("pipeline", "data_replicate", "data_shard", "sequence", "tensor")
PURPOSES = {
    "shard": ("data_shard", "sequence"),
    "replicate": ("data_replicate",),
    "replicas": ("data_replicate", "data_shard", "sequence"),
    "data": ("data_replicate", "data_shard"),
    "tensor": ("tensor",),
    "sequence": ("sequence",),
    "pipeline": ("pipeline",),
}


@dataclass(frozen=True)
class ParallelSizes:
    """How many ranks each dimension of the grid has."""

    pipeline: int = 1
    data_replicate: int = 1
    data_shard: int = 1
    sequence: int = 1
    tensor: int = 1

    def __post_init__(self) -> None:
        for name in DIMENSIONS:
            if getattr(self, name) < 1:
                raise ValueError(f"parallel size {name}={getattr(self, name)} must be at least 1")

    @property
    def world(self) -> int:
        return math.prod(self.shape)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, name) for name in DIMENSIONS)

    def size(self, purpose: str) -> int:
        return math.prod(getattr(self, name) for name in PURPOSES[purpose])

    @classmethod
    def of_job(cls, world_size: int, *, tensor: int = 1, sequence: int = 1, pipeline: int = 1,
               shard_size: int | None = None) -> "ParallelSizes":
        """The grid for `world_size` ranks: data parallelism is what tensor, sequence and
        pipeline leave (world ÷ (tp·sp·pp)); ZeRO shards over `shard_size` of those data
        ranks (hybrid sharding) and replicates over the rest, or over all of them (None)."""
        model_parallel = tensor * sequence * pipeline
        if world_size % model_parallel:
            raise ValueError(f"{world_size} processes cannot hold tensor x sequence x pipeline = {tensor} x "
                             f"{sequence} x {pipeline} = {model_parallel} ranks per model replica: the data-parallel "
                             "size is world / (tp·sp·pp); start a multiple of it, or change the sizes")
        data = world_size // model_parallel
        shard = data if shard_size is None else shard_size
        if data % shard:
            raise ValueError(f"a shard group of {shard} ranks does not divide the {data} data-parallel ranks "
                             "(hybrid sharding replicates whole shard groups)")
        return cls(pipeline, data // shard, shard, sequence, tensor)

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's index along every dimension."""
        index = {}
        for name, size in zip(reversed(DIMENSIONS), reversed(self.shape)):
            index[name] = rank % size
            rank //= size
        return {name: index[name] for name in DIMENSIONS}

    def groups(self, purpose: str) -> list[list[int]]:
        """Every group of `purpose` as sorted global ranks, in a fixed order (all ranks must
        create groups in the same order)."""
        grid = torch.arange(self.world).reshape(self.shape)
        inside = [DIMENSIONS.index(name) for name in PURPOSES[purpose]]
        outside = [axis for axis in range(len(DIMENSIONS)) if axis not in inside]
        blocks = grid.permute(*outside, *inside).reshape(-1, self.size(purpose))
        return [sorted(block.tolist()) for block in blocks]

    def group_of(self, purpose: str, rank: int) -> list[int]:
        return next(group for group in self.groups(purpose) if rank in group)

    def describe(self) -> str:
        return " x ".join(f"{name} {size}" for name, size in zip(DIMENSIONS, self.shape))


@dataclass(frozen=True)
class GroupHandle:
    """One purpose's groups as seen from this rank: its members, position, and the data
    and control process groups (None when the world is a single process)."""

    purpose: str
    ranks: tuple[int, ...]
    rank: int  # position of this process in `ranks`
    group: dist.ProcessGroup | None
    control: dist.ProcessGroup | None

    @property
    def size(self) -> int:
        return len(self.ranks)

    def describe(self) -> str:
        members = f"ranks {self.ranks[0]}-{self.ranks[-1]}" if self._consecutive() else f"ranks {list(self.ranks)}"
        return f"{self.purpose} group ({members})"

    def _consecutive(self) -> bool:
        return len(self.ranks) > 1 and list(self.ranks) == list(range(self.ranks[0], self.ranks[-1] + 1))


class ParallelMesh:
    """The grid of one job: sizes, this rank's coordinates and one `GroupHandle` per purpose."""

    def __init__(self, sizes: ParallelSizes, rank: int, device: torch.device, timeout: datetime.timedelta,
                 comm_stats: CommStats | None = None):
        """`comm_stats`: where communicators over the mesh's groups count their bytes (the
        engine's, so `comm_volume()` shows every group's)."""
        from shardwise.runtime.distributed.collectives import CommStats

        self.sizes = sizes
        self.rank = rank
        self.device = device
        self.comm_stats = comm_stats if comm_stats is not None else CommStats()
        self.coordinates = sizes.coordinates(rank)
        self.device_mesh = None
        if sizes.world == 1 or not dist.is_initialized():
            self.handles = {purpose: GroupHandle(purpose, (rank,), 0, None, None) for purpose in PURPOSES}
            return
        if dist.get_world_size() != sizes.world:
            raise ValueError(f"the parallel layout ({sizes.describe()}) needs {sizes.world} processes, "
                             f"but the job has {dist.get_world_size()}")
        from torch.distributed.device_mesh import init_device_mesh

        options = _group_options(device, timeout)
        with mesh_groups_time_out_after(timeout):
            self.device_mesh = init_device_mesh(
                device.type, sizes.shape, mesh_dim_names=DIMENSIONS,
                backend_override=dict.fromkeys(DIMENSIONS, options),
            )
            flattened = {purpose: self.device_mesh[dims]._flatten(purpose, backend_override=options)
                         for purpose, dims in PURPOSES.items() if len(dims) > 1}
        self.handles = {}
        for purpose, dims in PURPOSES.items():
            submesh = flattened[purpose] if len(dims) > 1 else self.device_mesh[dims]
            ranks = tuple(sizes.group_of(purpose, rank))
            control = _control_group(sizes.groups(purpose), rank, timeout) if len(ranks) > 1 else None
            self.handles[purpose] = GroupHandle(purpose, ranks, ranks.index(rank), submesh.get_group(), control)

    def __getitem__(self, purpose: str) -> GroupHandle:
        return self.handles[purpose]

    @property
    def data_rank(self) -> int:
        """Which slice of each global batch this rank reads."""
        return self.handles["data"].rank

    @property
    def data_size(self) -> int:
        return self.handles["data"].size

    def describe(self) -> str:
        return self.sizes.describe()


def _group_options(device: torch.device, timeout: datetime.timedelta) -> tuple[str, object]:
    """The mesh's groups get the collective timeout too (torch's default is 30 minutes)."""
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        backend = "nccl"
    else:
        options = dist.ProcessGroupGloo._Options()
        backend = "gloo"
    options._timeout = timeout
    return backend, options


def _control_group(groups: list[list[int]], rank: int, timeout: datetime.timedelta) -> dist.ProcessGroup:
    """A gloo group per member list; every rank creates all of them (new_group is collective)."""
    mine = None
    for members in groups:
        group = dist.new_group(members, backend="gloo", timeout=timeout)
        if rank in members:
            mine = group
    return mine
