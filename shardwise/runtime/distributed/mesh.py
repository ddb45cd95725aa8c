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

Past one node, the links between nodes are slower than those inside one, so the mesh also
knows the node of every rank (`ranks_per_node`, from the launcher's LOCAL_WORLD_SIZE or
the config; ranks r*L .. r*L+L-1 share node r) and cuts groups by it:

    node         the ranks on this node (intra-node)
    nodes        one rank per node, at this rank's place in its node (inter-node)
    shard_node   the shard group's ranks on this node  } ZeRO++'s hierarchy (C28):
    shard_nodes  the shard group's ranks at this rank's } qgZ reduces inside a node first,
                 place on every node                   } then across nodes
    secondary    hpZ's secondary partition: `secondary_shard` ranks of shard_node

Mixture-of-experts layers carve two more groups out of each data group, for an
expert-parallel size E that divides it (built on demand: `ParallelMesh.expert_handles`,
since the size comes from the model's layers, not the job's layout):

    expert       E consecutive members of this rank's data group: each holds 1/E of a
                 layer's experts, and tokens travel between them by all-to-all
    expert_data  the members at this rank's place in every expert group: they hold the
                 same experts, whose gradients are summed over it

DeepSpeed's `use_data_before_expert_parallelism` (`data_before_expert`) swaps the two: an
expert group takes every (D/E)-th member of the data group, and the members holding the
same experts are consecutive (D + E instead of E + D; DeepSpeed 0.19.8 has it without
tensor or sequence parallelism only, and so does shardwise).

Every group knows its members' nodes, so a communicator counts the bytes it sends over
links inside a node and between nodes apart (collectives.py).

Each purpose has a data group (for NCCL, on the device) from torch's `DeviceMesh`, and a
CPU-side gloo *control* group for small agreement collectives, created up front so that
creating a group never happens in the middle of training. A layout's groups are built once
per process and shared by every engine built on it (group_cache.py), so engines built and
destroyed one after another do not pile up groups and their threads. `DeviceMesh._flatten`
(how torchtitan names merged dimensions) is private torch API; it is the only one used here.
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from shardwise.runtime.base.torch_compat import mesh_groups_time_out_after
from shardwise.runtime.distributed.group_cache import shared_groups

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
NODE_PURPOSES = ("node", "nodes", "shard_node", "shard_nodes", "secondary")


@dataclass(frozen=True)
class ParallelSizes:
    """How many ranks each dimension of the grid has."""

    pipeline: int = 1
    data_replicate: int = 1
    data_shard: int = 1
    sequence: int = 1
    tensor: int = 1
    ranks_per_node: int | None = None  # None: every rank on one node
    secondary_shard: int = 1  # hpZ: ranks of a node's shard-group ranks that hold one secondary partition
    shard_by_node: bool = False  # build ZeRO++'s groups (shard_node, shard_nodes, secondary)
    data_before_expert: bool = False  # expert groups strided, expert-data groups consecutive (see above)

    def __post_init__(self) -> None:
        for name in DIMENSIONS:
            if getattr(self, name) < 1:
                raise ValueError(f"parallel size {name}={getattr(self, name)} must be at least 1")
        if self.ranks_per_node is not None and (self.ranks_per_node < 1 or self.world % self.ranks_per_node):
            raise ValueError(f"{self.ranks_per_node} ranks per node do not divide the {self.world} ranks of the job: "
                             "every node must hold the same number of ranks")
        if self.secondary_shard < 1:
            raise ValueError(f"secondary_shard {self.secondary_shard} must be at least 1")

    @property
    def world(self) -> int:
        return math.prod(self.shape)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, name) for name in DIMENSIONS)

    def size(self, purpose: str) -> int:
        if purpose in PURPOSES:
            return math.prod(getattr(self, name) for name in PURPOSES[purpose])
        return len(self.groups(purpose)[0])

    @property
    def node_size(self) -> int:
        """Ranks per node (the whole job when the node size is unknown)."""
        return self.ranks_per_node or self.world

    @property
    def nodes(self) -> int:
        return self.world // self.node_size

    def node_of(self, rank: int) -> int:
        return rank // self.node_size

    @classmethod
    def of_job(cls, world_size: int, *, tensor: int = 1, sequence: int = 1, pipeline: int = 1,
               shard_size: int | None = None, ranks_per_node: int | None = None, secondary_shard: int = 1,
               shard_by_node: bool = False, data_before_expert: bool = False) -> "ParallelSizes":
        """The grid for `world_size` ranks: data parallelism is what tensor, sequence and
        pipeline leave (world ÷ (tp·sp·pp)); ZeRO shards over `shard_size` of those data
        ranks (hybrid sharding) and replicates over the rest, or over all of them (None).
        `ranks_per_node`, `secondary_shard`, `shard_by_node`: the node topology and
        ZeRO++'s groups; `data_before_expert`: the experts' groups' order (see the module's
        docstring)."""
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
        return cls(pipeline, data // shard, shard, sequence, tensor, ranks_per_node, secondary_shard,
                   shard_by_node or secondary_shard > 1, data_before_expert)

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
        if purpose in NODE_PURPOSES:
            return self._node_groups(purpose)
        grid = torch.arange(self.world).reshape(self.shape)
        inside = [DIMENSIONS.index(name) for name in PURPOSES[purpose]]
        outside = [axis for axis in range(len(DIMENSIONS)) if axis not in inside]
        blocks = grid.permute(*outside, *inside).reshape(-1, self.size(purpose))
        return [sorted(block.tolist()) for block in blocks]

    def group_of(self, purpose: str, rank: int) -> list[int]:
        return next(group for group in self.groups(purpose) if rank in group)

    def _node_groups(self, purpose: str) -> list[list[int]]:
        size = self.node_size
        if purpose == "node":
            return [list(range(start, start + size)) for start in range(0, self.world, size)]
        if purpose == "nodes":
            return [list(range(place, self.world, size)) for place in range(size)]
        per_node = [self._shard_by_node(group) for group in self.groups("shard")]
        if purpose == "shard_node":
            return [block for blocks in per_node for block in blocks]
        if purpose == "shard_nodes":
            return [[block[place] for block in blocks] for blocks in per_node for place in range(len(blocks[0]))]
        secondary = self.secondary_shard
        if len(per_node[0][0]) % secondary:
            raise ValueError(f"a secondary partition of {secondary} ranks (zero_hpz_partition_size) does not divide "
                             f"the {len(per_node[0][0])} ranks of a shard group on each node; use a divisor of it")
        return [block[start : start + secondary] for blocks in per_node for block in blocks
                for start in range(0, len(block), secondary)]

    def _shard_by_node(self, group: list[int]) -> list[list[int]]:
        """A shard group's ranks node by node; ZeRO++'s hierarchy needs as many on every node."""
        blocks: dict[int, list[int]] = {}
        for rank in group:
            blocks.setdefault(self.node_of(rank), []).append(rank)
        counts = {node: len(block) for node, block in blocks.items()}
        if len(set(counts.values())) > 1:
            raise ValueError(f"the shard group {group} has {counts} ranks on nodes {sorted(counts)}: ZeRO++'s "
                             "node hierarchy needs the same number on every node; use a layout whose shard "
                             "groups spread evenly (tensor and pipeline sizes that divide the ranks per node)")
        return list(blocks.values())

    def expert_groups(self, expert: int) -> dict[str, list[list[int]]]:
        """{"expert": ..., "expert_data": ...} for an expert-parallel size `expert` (see the
        module's docstring): each data group cut into runs of `expert` members, and the
        members at one place of every run; with `data_before_expert`, runs of D/E members
        hold the same experts and the members at one place of every run form an expert group."""
        data = self.size("data")
        if expert < 1 or data % expert:
            raise ValueError(f"an expert-parallel size of {expert} (ep_size) does not divide the {data} data-parallel "
                             "ranks it is carved from; use a divisor of world / (tp·sp·pp)")
        width = data // expert if self.data_before_expert else expert
        if self.data_before_expert and self.tensor * self.sequence > 1:
            raise ValueError("use_data_before_expert_parallelism with tensor or sequence parallelism: DeepSpeed 0.19.8 "
                             "has that order only without them (it raises NotImplementedError), and so does shardwise; "
                             "set it to false, or tensor_parallel.size and sequence_parallel.size to 1")
        runs = [group[start : start + width] for group in self.groups("data") for start in range(0, data, width)]
        strided = [group[place::width] for group in self.groups("data") for place in range(width)]
        if self.data_before_expert:
            return {"expert": strided, "expert_data": runs}
        return {"expert": runs, "expert_data": strided}

    def describe(self) -> str:
        grid = " x ".join(f"{name} {size}" for name, size in zip(DIMENSIONS, self.shape))
        return grid if self.nodes == 1 else f"{grid} ({self.nodes} nodes of {self.node_size})"


@dataclass(frozen=True)
class GroupHandle:
    """One purpose's groups as seen from this rank: its members, position, and the data
    and control process groups (None when the world is a single process). `nodes`: the
    node of each member, when the job spans several (None: one node)."""

    purpose: str
    ranks: tuple[int, ...]
    rank: int  # position of this process in `ranks`
    group: dist.ProcessGroup | None
    control: dist.ProcessGroup | None
    nodes: tuple[int, ...] | None = None

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
        self._timeout = timeout
        if sizes.world == 1 or not dist.is_initialized():
            self.handles = {purpose: GroupHandle(purpose, (rank,), 0, None, None)
                            for purpose in (*PURPOSES, *self.node_purposes)}
            return
        if dist.get_world_size() != sizes.world:
            raise ValueError(f"the parallel layout ({sizes.describe()}) needs {sizes.world} processes, "
                             f"but the job has {dist.get_world_size()}")

        def build() -> tuple[object, dict[str, GroupHandle]]:
            self._build_groups()
            return self.device_mesh, self.handles

        # one set of groups per layout for the whole process, shared by its engines (group_cache.py)
        self.device_mesh, self.handles = shared_groups(("mesh", sizes, rank, device, timeout), build)

    def _build_groups(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        sizes, rank, timeout = self.sizes, self.rank, self._timeout
        options = _group_options(self.device, timeout)
        with mesh_groups_time_out_after(timeout):
            self.device_mesh = init_device_mesh(
                self.device.type, sizes.shape, mesh_dim_names=DIMENSIONS,
                backend_override=dict.fromkeys(DIMENSIONS, options),
            )
            flattened = {purpose: self.device_mesh[dims]._flatten(purpose, backend_override=options)
                         for purpose, dims in PURPOSES.items() if len(dims) > 1}
        self.handles = {}
        for purpose, dims in PURPOSES.items():
            submesh = flattened[purpose] if len(dims) > 1 else self.device_mesh[dims]
            ranks = tuple(sizes.group_of(purpose, rank))
            control = _control_group(sizes.groups(purpose), rank, timeout) if len(ranks) > 1 else None
            self.handles[purpose] = GroupHandle(purpose, ranks, ranks.index(rank), submesh.get_group(), control,
                                                self._nodes_of(ranks))
        for purpose in self.node_purposes:
            self.handles[purpose] = self._node_handle(purpose, options, timeout)

    @property
    def node_purposes(self) -> tuple[str, ...]:
        """The node-cut groups this job builds: node and nodes always, ZeRO++'s when asked."""
        return NODE_PURPOSES if self.sizes.shard_by_node else NODE_PURPOSES[:2]

    def _nodes_of(self, ranks: tuple[int, ...]) -> tuple[int, ...] | None:
        return tuple(self.sizes.node_of(member) for member in ranks) if self.sizes.nodes > 1 else None

    def _node_handle(self, purpose: str, options: tuple[str, object], timeout: datetime.timedelta) -> GroupHandle:
        """A node-cut group: none for a group of one, the process groups of a grid purpose
        with the same members (one node: `node` is often the data group), else new ones."""
        groups = self.sizes.groups(purpose)
        ranks = tuple(next(group for group in groups if self.rank in group))
        nodes = self._nodes_of(ranks)
        if len(ranks) == 1:
            return GroupHandle(purpose, ranks, 0, None, None, nodes)
        same = next((self.handles[other] for other in PURPOSES if self.sizes.groups(other) == groups), None)
        if same is not None:
            return GroupHandle(purpose, ranks, ranks.index(self.rank), same.group, same.control, nodes)
        backend, backend_options = options
        nccl_options = backend_options if backend == "nccl" else None  # gloo takes its timeout alone
        data = None
        for members in groups:  # new_group is collective: every rank creates every group, in order
            group = dist.new_group(members, backend=backend, pg_options=nccl_options, timeout=timeout)
            if self.rank in members:
                data = group
        control = _control_group(groups, self.rank, timeout)
        return GroupHandle(purpose, ranks, ranks.index(self.rank), data, control, nodes)

    def __getitem__(self, purpose: str) -> GroupHandle:
        return self.handles[purpose]

    def expert_handles(self, expert: int) -> tuple[GroupHandle, GroupHandle]:
        """(expert, expert_data) handles for expert-parallel size `expert`, created once per
        size and kept with the layout's other groups, for later engines too (collective:
        every rank asks for the same sizes in the same order)."""
        key = f"expert_{expert}"
        if key not in self.handles:
            groups = self.sizes.expert_groups(expert)
            timeout = self._timeout
            for purpose in ("expert", "expert_data"):
                self.handles[f"{purpose}_{expert}"] = self._handle_over(purpose, groups[purpose], timeout)
        return self.handles[key], self.handles[f"expert_data_{expert}"]

    def _handle_over(self, purpose: str, groups: list[list[int]], timeout: datetime.timedelta) -> GroupHandle:
        """A handle on this rank's group of `groups`: new process groups unless it is of one."""
        ranks = tuple(next(group for group in groups if self.rank in group))
        nodes = self._nodes_of(ranks)
        if len(ranks) == 1 or not dist.is_initialized():
            return GroupHandle(purpose, ranks, ranks.index(self.rank), None, None, nodes)
        backend, backend_options = _group_options(self.device, timeout)
        data = None
        for members in groups:  # new_group is collective: every rank creates every group, in order
            group = dist.new_group(members, backend=backend,
                                   pg_options=backend_options if backend == "nccl" else None, timeout=timeout)
            if self.rank in members:
                data = group
        return GroupHandle(purpose, ranks, ranks.index(self.rank), data, _control_group(groups, self.rank, timeout),
                           nodes)

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
