"""The job an engine trains in: the process group, the ranks' agreement, the mesh.

Built once per engine before anything touches the model (`start_job`), in this order:
join (or start) the process group; check, with one small all-gather, that every rank has
the same policies and the same model (distributed/agreement.py); build the mesh of groups
by purpose (distributed/mesh.py). A model family's `parallelize` and the engine then take
their groups from `job.mesh` and count their bytes in `job.stats`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from torch import nn

from shardwise.runtime.distributed.agreement import (RankMismatchError, check_ranks_agree, describe_config,
                                                     describe_model)
from shardwise.runtime.distributed.collectives import CommStats, Communicator
from shardwise.runtime.distributed.mesh import ParallelMesh, ParallelSizes
from shardwise.runtime.distributed.peers import PeerDirectory, absent_ranks, sign_in
from shardwise.runtime.distributed.setup import DistributedContext, init_distributed, world_handle
from shardwise.runtime.distributed.topology import ranks_per_node
from shardwise.runtime.engine.policies import Policies


@dataclass
class Job:
    context: DistributedContext
    mesh: ParallelMesh
    world: Communicator  # every rank: start-up agreement, collective API calls
    stats: CommStats  # bytes every communicator of this engine sent
    peers: PeerDirectory


def parallel_sizes(policies: Policies, world_size: int) -> ParallelSizes:
    """The mesh the policies ask for: ZeRO shards over the data ranks (all of them, or
    `zero.shard_size` with hybrid sharding); stage 0 shards nothing. The node size and
    ZeRO++'s groups cut by node (hpZ's secondary partition, qgZ's two hops)."""
    zero = policies.zero
    shard = zero.shard_size if zero.partitions_model_states else 1
    plus_plus = zero.plus_plus
    return ParallelSizes.of_job(world_size, tensor=policies.tensor.size, sequence=policies.sequence.size,
                                pipeline=policies.pipeline.size, shard_size=shard,
                                ranks_per_node=ranks_per_node(policies.topology, world_size),
                                secondary_shard=plus_plus.hpz_partition_size,
                                shard_by_node=plus_plus.quantized_gradients,
                                data_before_expert=policies.expert.data_before_expert)


def start_job(model: nn.Module, policies: Policies, optimizer: torch.optim.Optimizer | None = None,
              context: DistributedContext | None = None, settings: Mapping[str, Any] | None = None) -> Job:
    """Join the job and check that ranks agree before `model` is changed. `settings`: the
    policies as the user wrote them (a DeepSpeed config), so that a difference between
    ranks is named by the user's key; default: the policies' own fields."""
    context = context or init_distributed()
    sizes = parallel_sizes(policies, context.world_size)
    stats = CommStats()
    start = sign_in(context.rank) if context.group is not None else None
    try:
        world = Communicator(world_handle(context), stats)
        peers = check_ranks_agree(
            world,
            describe_config(dict(settings) if settings is not None else describe_policies(policies), optimizer),
            describe_model(model, _param_group_of(optimizer)),
            sizes.groups("replicas"),
            device=context.device,
        )
        world.peers = peers
        mesh = ParallelMesh(sizes, context.rank, context.device, context.timeout, comm_stats=stats)
    except RankMismatchError:
        raise
    except RuntimeError as error:  # gloo's "Wait timeout", a lost connection: name who is missing
        absent = absent_ranks(start, context.world_size) if start is not None else ""
        if not absent:
            raise
        raise RuntimeError(f"rank {context.rank}: the job's start-up (initialize) failed: {absent} ({error})") \
            from error
    return Job(context, mesh, world, stats, peers)


def describe_policies(policies: Any) -> Any:
    """The policies as plain values, the same on every rank that has the same policies
    (dtypes by name, functions by qualified name)."""
    if dataclasses.is_dataclass(policies):
        return {f.name: describe_policies(getattr(policies, f.name)) for f in dataclasses.fields(policies)}
    if isinstance(policies, dict):
        return {str(key): describe_policies(value) for key, value in policies.items()}
    if isinstance(policies, (list, tuple)):
        return [describe_policies(value) for value in policies]
    if isinstance(policies, torch.dtype):
        return str(policies)
    if callable(policies):
        return f"{getattr(policies, '__module__', '?')}.{getattr(policies, '__qualname__', type(policies).__name__)}"
    return policies


def _param_group_of(optimizer: torch.optim.Optimizer | None) -> Callable[[nn.Parameter], int | None]:
    groups = {id(p): index for index, group in enumerate(optimizer.param_groups)
              for p in group["params"]} if optimizer else {}
    return lambda param: groups.get(id(param))
