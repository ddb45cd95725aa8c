"""`apply_zero`: the last step of the apply order, which takes over a model's parameters.

It builds, in order: the layout (units over the shard group), the parameter strategy
(whole parameters, or 1/N partitioned and gathered on use), the shard store (masters and
gradient buffers), the gradient reducer (hooks that reduce during backward) and the
sharded optimizer. The result, `ZeroState`, is what the engine drives and what checkpoints
and `gathered_parameters` read through its small protocol: owned ranges in global
coordinates (trained, sub-group by sub-group, and held untrained), the unit holding each
parameter, the optimizer state codec, release of gathered parameters, refresh from
masters. Nothing outside zero/ needs to know how the parameter strategy, the groups or
the shard store are arranged.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from itertools import groupby
from typing import Callable, Iterator

import torch
from torch import nn

from shardwise.runtime.accounting import MemoryLedger
from shardwise.runtime.distributed.collectives import Communicator
from shardwise.runtime.distributed.staging import staged_on
from shardwise.runtime.zero.host_store import HostShardStore
from shardwise.runtime.zero.param_home import merge_transfers
from shardwise.runtime.zero.parked_states import StateKind, optimizer_state_tensors
from shardwise.runtime.zero.nvme_store import NvmeShardStore
from shardwise.runtime.zero.split_store import make_split_store
from shardwise.runtime.optim.codec import StateCodec
from shardwise.runtime.precision.policy import PrecisionPolicy
from shardwise.runtime.zero.gradients import GradientReducer
from shardwise.runtime.zero.layout import FlatUnit, align_elements, pack_units
from shardwise.runtime.zero.partitioned_params import PartitionedParameters
from shardwise.runtime.zero.policy import ZeroPolicy
from shardwise.runtime.zero.replicated_params import ReplicatedParameters
from shardwise.runtime.zero.shard_store import DeviceShardStore, SegmentState, ShardStore, StoreSpec
from shardwise.runtime.zero.shard_view import HeldPiece, OwnedRange, owned_ranges
from shardwise.runtime.zero.sharded_optimizer import ShardedOptimizer
from shardwise.runtime.zero.strategy import ParameterStrategy


@dataclass(frozen=True)
class ZeroGroups:
    """The communicators ZeRO uses, by purpose (distributed/mesh.py)."""

    shard: Communicator  # model states are partitioned over it
    replicate: Communicator  # holds identical shards; gradients all-reduced over it
    replicas: Communicator  # every rank with the same model: initial values broadcast over it
    # ZeRO++ (C28): hpZ's secondary partition group, qgZ's hops inside and across nodes
    secondary: Communicator | None = None
    shard_node: Communicator | None = None
    shard_nodes: Communicator | None = None


@dataclass
class ZeroState:
    policy: ZeroPolicy
    groups: ZeroGroups
    params: ParameterStrategy
    store: ShardStore | None  # the three training parts; None in an engine without an optimizer
    reducer: GradientReducer | None
    optimizer: ShardedOptimizer | None
    unit_of_param: dict[int, FlatUnit] = field(init=False)  # id(parameter) -> the unit holding it

    def __post_init__(self) -> None:
        self.unit_of_param = {id(slot.param): unit for unit in [*self.units, *self.frozen_units]
                              for slot in unit.slots}

    @property
    def units(self) -> list[FlatUnit]:
        """What the optimizer trains (an engine without one: every parameter it holds)."""
        return self.params.units

    @property
    def frozen_units(self) -> Sequence[FlatUnit]:
        """Parameters held but never trained: stage 3 partitions frozen ones too."""
        return self.params.frozen_units

    @property
    def shard_rank(self) -> int:
        """Which chunk of every unit this rank owns."""
        return self.groups.shard.rank

    # -- the protocol checkpoints and gathered_parameters use ------------------------------
    def owned_ranges(self) -> list[OwnedRange]:
        """Every trained element this rank owns, by parameter name and global range."""
        return owned_ranges(self.units, self.store, self.shard_rank, self.groups.shard.handle)

    def owned_ranges_by_sub_group(self) -> Iterator[list[OwnedRange]]:
        """`owned_ranges()` one optimizer sub-group at a time, each yielded while its
        sub-group is resident, so a paging store (NVMe) holds one at a time and writes the
        masters back after it."""
        ranges = sorted(self.owned_ranges(), key=lambda owned: self.store.sub_group_index(owned.segment))
        for index, in_group in groupby(ranges, key=lambda owned: self.store.sub_group_index(owned.segment)):
            with self.resident(index):
                yield list(in_group)

    def sub_group_index(self, segment: SegmentState) -> int:
        return self.store.sub_group_index(segment)

    def resident(self, sub_group: int | None) -> AbstractContextManager[list[SegmentState]]:
        """Optimizer sub-group `sub_group` (None: none) in memory for the block."""
        return self.store.resident(self.store.sub_groups[sub_group] if sub_group is not None else [])

    def adopt_optimizer_state(self) -> None:
        """The torch optimizer's state was replaced (a checkpoint load): a paging store
        moves it into its pages, and its bytes are counted again."""
        for sub_group in self.store.sub_groups:
            with self.store.resident(sub_group):
                self.store.adopt_state(sub_group, self.optimizer.optimizer.state)
        self.optimizer.record_state_bytes()

    def untrained_pieces(self) -> list[HeldPiece]:
        """The parameters held without training (stage 3's partitioned frozen ones; every
        parameter of an engine without an optimizer): this rank's pieces, in the local
        tensor's flat coordinates; the values are views of its shards (or of its chunk of
        the whole parameters), so a load writes straight into them."""
        pieces = []
        for unit in [*self.frozen_units, *(() if self.optimizer is not None else self.units)]:
            chunk = self.params.owned_chunk(unit)
            for piece in unit.owned_pieces(self.shard_rank):
                values = chunk[piece.chunk_offset : piece.chunk_offset + piece.numel]
                pieces.append(HeldPiece(piece.slot.name, piece.start, piece.stop, values))
        return pieces

    @property
    def writes_model(self) -> bool:
        """One rank per set of replicas saves model and optimizer data (the first)."""
        return self.groups.replicate.rank == 0

    @property
    def codec(self) -> StateCodec:
        return self.optimizer.codec

    def release_gathered(self) -> None:
        self.params.release_gathered()

    def state_tensors(self, module: nn.Module) -> dict[StateKind, list[torch.Tensor]]:
        """The tensors holding each kind of training state (zero/parked_states.py), any of
        them possibly sharing a storage with another kind's (fp32 masters are the parameters)."""
        units = [*self.units, *self.frozen_units]
        by_kind = {StateKind.PARAMETERS: [*module.parameters(), *(self.params.owned_chunk(unit) for unit in units)]}
        if self.optimizer is None:
            return by_kind
        full = [self.store.full_gradient(unit) for unit in self.units]
        by_kind[StateKind.GRADIENTS] = [*self.store.gradients(), *(grad for grad in full if grad is not None),
                                        *(param.grad for param in module.parameters() if param.grad is not None)]
        by_kind[StateKind.MASTER_PARAMETERS] = [segment.master for segment in self.store.segments]
        by_kind[StateKind.OPTIMIZER_STATES] = optimizer_state_tensors(self.optimizer.optimizer)
        by_kind[StateKind.GRADIENT_BUCKETS] = self.reducer.pooled_buckets()
        return by_kind

    def await_readers(self) -> None:
        """Collective: no rank reads the parameter shards any more (before a load rewrites them)."""
        self.params.await_readers()

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


def _make_store(policy: ZeroPolicy, params: ParameterStrategy, *, precision: PrecisionPolicy, chunk: int,
                ledger: MemoryLedger, device: torch.device, per_parameter: bool, rank: int) -> ShardStore:
    """The shard store of the tier `offload_optimizer.device` names."""
    spec = StoreSpec(params.units, chunk, params, precision.accumulation_dtype, policy.keeps_full_gradients,
                     policy.sub_group_size, ledger, device, per_parameter, precision.master_dtype,
                     precision.param_dtype)
    offload = policy.offload_optimizer
    if offload.enabled and precision.master_dtype != torch.float32:
        raise ValueError(f"master_dtype {precision.master_dtype} with offload_optimizer.device '{offload.device}': "
                         "the offloaded step keeps fp32 masters on the host; keep the optimizer on the device")
    if not policy.partitions_model_states and precision.master_dtype != torch.float32:
        raise ValueError("16-bit masters need ZeRO stage 1, 2 or 3: they are the partitioned copies ZeRO keeps")
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
            ledger=ledger, align=align, param_init_fn=param_init_fn, frozen=frozen, secondary=groups.secondary,
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
    store = _make_store(policy, params, precision=precision, chunk=groups.shard.rank, ledger=ledger, device=device,
                        per_parameter=per_parameter, rank=groups.shard.global_rank)
    params.settle()
    reducer = GradientReducer(params.units, policy, grad_dtype=dtype, accumulation_dtype=precision.accumulation_dtype,
                              comm_dtype=precision.communication_dtype,
                              store=store, shard=groups.shard, replicate=groups.replicate, ledger=ledger,
                              device=device, hierarchy=(groups.shard_node, groups.shard_nodes))
    params.connect(reducer)
    shard_device = groups.shard.staging_device

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
