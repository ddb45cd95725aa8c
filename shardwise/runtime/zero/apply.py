"""`apply_zero`: the last step of the apply order, which takes over a model's parameters.

It builds, in order: the layout (units over the shard group), the parameter strategy
(whole parameters, or 1/N partitioned and gathered on use), the shard store (masters and
gradient buffers), the gradient reducer (hooks that reduce during backward) and the
sharded optimizer. The result, `ZeroState`, is what the engine drives and what checkpoints
and `gathered_parameters` read through its small protocol: owned ranges in global
coordinates, the optimizer state codec, release of gathered parameters, refresh from
masters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from shardwise.runtime.accounting import MemoryLedger
from shardwise.runtime.distributed.collectives import Communicator
from shardwise.runtime.distributed.staging import group_device, staged_on
from shardwise.runtime.zero.host_store import HostShardStore
from shardwise.runtime.zero.param_home import merge_transfers
from shardwise.runtime.zero.nvme_store import NvmeShardStore
from shardwise.runtime.zero.split_store import make_split_store
from shardwise.runtime.optim.codec import StateCodec
from shardwise.runtime.precision.policy import PrecisionPolicy
from shardwise.runtime.zero.gradients import GradientReducer
from shardwise.runtime.zero.layout import FlatUnit, align_elements, pack_units
from shardwise.runtime.zero.partitioned_params import PartitionedParameters
from shardwise.runtime.zero.policy import ZeroPolicy
from shardwise.runtime.zero.replicated_params import ReplicatedParameters
from shardwise.runtime.zero.shard_store import DeviceShardStore, ShardStore, StoreSpec
from shardwise.runtime.zero.shard_view import OwnedRange, owned_ranges
from shardwise.runtime.zero.sharded_optimizer import ShardedOptimizer
from shardwise.runtime.zero.strategy import ParameterStrategy


@dataclass(frozen=True)
class ZeroGroups:
    """The communicators ZeRO uses, by purpose (distributed/mesh.py)."""

    shard: Communicator  # model states are partitioned over it
    replicate: Communicator  # holds identical shards; gradients all-reduced over it
    replicas: Communicator  # every rank with the same model: initial values broadcast over it


@dataclass
class ZeroState:
    policy: ZeroPolicy
    groups: ZeroGroups
    params: ParameterStrategy
    store: ShardStore | None  # the three training parts; None in an engine without an optimizer
    reducer: GradientReducer | None
    optimizer: ShardedOptimizer | None

    @property
    def units(self) -> list[FlatUnit]:
        return self.params.units

    # -- the protocol checkpoints and gathered_parameters use ------------------------------
    def owned_ranges(self) -> list[OwnedRange]:
        """Every trained element this rank owns, by parameter name and global range."""
        return owned_ranges(self.units, self.store, self.groups.shard.rank, self.groups.shard.handle)

    @property
    def writes_model(self) -> bool:
        """One rank per set of replicas saves model and optimizer data (the first)."""
        return self.groups.replicate.rank == 0

    @property
    def codec(self) -> StateCodec:
        return self.optimizer.codec

    def release_gathered(self) -> None:
        self.params.release_gathered()

    def transfers(self) -> dict[str, int]:
        """Bytes moved between memory tiers: optimizer paging and parameter paging."""
        return merge_transfers(self.store.transfers() if self.store is not None else {}, self.params.transfers())

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
        self.params.close()

    def refresh_from_masters(self) -> None:
        """Masters were rewritten (a checkpoint load): make parameters match, as after a step.
        Without an optimizer the owned chunks themselves were rewritten: gather those."""
        if self.store is not None:
            self.store.publish()
        self.params.after_update()
        if self.reducer is not None:
            self.reducer.zero_grads()


def _make_store(policy: ZeroPolicy, params: ParameterStrategy, *, dtype: torch.dtype, chunk: int,
                ledger: MemoryLedger, per_parameter: bool, rank: int) -> ShardStore:
    """The shard store of the tier `offload_optimizer.device` names."""
    spec = StoreSpec(params.units, chunk, params, dtype, policy.keeps_full_gradients,
                     policy.sub_group_size, ledger, per_parameter)
    offload = policy.offload_optimizer
    if offload.enabled and offload.ratio < 1:
        return make_split_store(spec, offload=offload, rank=rank)
    if offload.device == "cpu":
        return HostShardStore(spec, pin_memory=offload.pin_memory)
    if offload.device == "nvme":
        return NvmeShardStore(spec, offload=offload, rank=rank)
    return DeviceShardStore(spec)


def apply_zero(
    model: nn.Module,
    named: list[tuple[str, nn.Parameter, int]],
    *,
    policy: ZeroPolicy,
    precision: PrecisionPolicy,
    groups: ZeroGroups,
    ledger: MemoryLedger,
    device: torch.device,
    make_optimizer: Callable[[list[list[torch.Tensor]]], torch.optim.Optimizer] | None,
    codec: StateCodec | None = None,
    param_init_fn: Callable[[nn.Module], None] | None = None,
    per_parameter: bool = False,
    frozen: list[tuple[str, nn.Parameter]] = (),
) -> ZeroState:
    """Partition `named` (name, parameter, param group) of `model` as `policy` says, in
    `precision.param_dtype`. `per_parameter`: the optimizer works on whole parameters
    (optim/sharded.py). `make_optimizer=None`: forward only (an engine without an
    optimizer, e.g. an RLHF reference model): the parameters are held as for training (1/N
    each at stage 3), but no fp32 masters, gradient buffers or optimizer state exist.
    `frozen`: parameters that are not trained; stage 3 partitions them too (others keep
    them whole)."""
    dtype = precision.param_dtype
    align = align_elements(dtype)
    params: ParameterStrategy
    if policy.partitions_parameters:
        params = PartitionedParameters(
            model, named, policy, dtype=dtype, device=device, shard=groups.shard, replicas=groups.replicas,
            ledger=ledger, align=align, param_init_fn=param_init_fn, frozen=frozen,
        )
    else:
        units = pack_units(reversed(named), policy.reduce_bucket_size, groups.shard.size, align)
        params = ReplicatedParameters(
            units, dtype, device, groups.shard, groups.replicas, ledger, policy.allgather_bucket_size
        )
        params.broadcast_initial()
    if make_optimizer is None:
        params.settle()
        return ZeroState(policy, groups, params, None, None, None)
    store = _make_store(policy, params, dtype=dtype, chunk=groups.shard.rank, ledger=ledger,
                        per_parameter=per_parameter, rank=groups.shard.global_rank)
    params.settle()
    reducer = GradientReducer(params.units, policy, grad_dtype=dtype, comm_dtype=precision.communication_dtype,
                              store=store, shard=groups.shard, replicate=groups.replicate, ledger=ledger,
                              device=device)
    params.connect(reducer)
    shard_device = group_device(groups.shard.group)

    def sum_data(tensor: torch.Tensor) -> torch.Tensor:
        """An offloaded optimizer assembles in host memory, which NCCL cannot move."""
        with staged_on(tensor, shard_device) as staged:
            groups.shard.all_reduce(staged, "whole parameters the optimizer assembles").wait()
        return tensor

    optimizer = ShardedOptimizer(
        store, ledger, make_optimizer, codec,
        sum_over_shards=lambda tensor: groups.shard.control_all_reduce(tensor, "whole-parameter optimizer statistics"),
        sum_data_over_shards=sum_data, reducer=reducer,
    )
    return ZeroState(policy, groups, params, store, reducer, optimizer)
