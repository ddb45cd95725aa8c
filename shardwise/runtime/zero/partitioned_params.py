"""Parameters in stage 3 (C4): which are partitioned, how units are formed, how a model
too large for one rank is built already partitioned, and the strategy interface the
engine, checkpoints and `gathered_parameters` use.

- Parameters smaller than `stage3_param_persistence_threshold` stay whole on every rank
  (gathering them would cost more latency than memory saved); they are trained like
  stage 2: packed into buckets, gradients reduce-scattered, updated chunks all-gathered.
- Every other parameter belongs to the unit of the first module that owns it; a unit is
  gathered whenever any module using it runs (tied weights join both modules). A leaf
  module (leaf_modules.py: a mixture of experts' block) owns every parameter below it, in
  one unit, and the modules below it get no hooks.
- Frozen parameters (requires_grad False: a LoRA model's base weights, a frozen encoder)
  of that size are partitioned the same way, in units of their own (`frozen_units`) that
  the shard store, gradient reducer and optimizer never see: 1/N of them per rank, no
  fp32 master, no gradient. Backward gathers them again for the input gradients it
  computes through them and frees them once those are done (gather_schedule.py).
- Units are numbered in reverse module order, roughly the order in which backward
  finishes their gradients, so reductions launch in order while backward runs.

Models on the meta device are materialised one module at a time: each module's
parameters are allocated, initialised (`param_init_fn(module)`, default
`module.reset_parameters()`) with a seed shared by all ranks, cut to this rank's shard
and freed, so peak memory is the model's shard plus one module, never the full model.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import chain
from typing import Callable

import torch
from torch import nn

from shardwise.runtime.accounting import MemoryLedger
from shardwise.runtime.distributed.collectives import Communicator
from shardwise.runtime.base.random_state import seeded_rng
from shardwise.runtime.zero.gather_schedule import GatherSchedule
from shardwise.runtime.zero.layout import FlatUnit, make_unit, pack_units
from shardwise.runtime.zero.leaf_modules import leaf_modules
from shardwise.runtime.zero.policy import ZeroPolicy
from shardwise.runtime.zero.replicated_params import ReplicatedParameters
from shardwise.runtime.zero.sharded_params import ShardedParameters
from shardwise.runtime.zero.strategy import ParameterStrategy


def _default_init(module: nn.Module) -> None:
    if not hasattr(module, "reset_parameters"):
        raise ValueError(
            f"{type(module).__name__} has parameters on the meta device but no "
            "reset_parameters(); pass param_init_fn to shardwise.initialize"
        )
    module.reset_parameters()


class PartitionedParameters(ParameterStrategy):
    def __init__(
        self,
        model: nn.Module,
        named: list[tuple[str, nn.Parameter, int]],
        policy: ZeroPolicy,
        *,
        dtype: torch.dtype,
        device: torch.device,
        shard: Communicator,
        replicas: Communicator,
        ledger: MemoryLedger,
        align: int,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        frozen: list[tuple[str, nn.Parameter]] = (),
        secondary: Communicator | None = None,
    ):
        """`dtype`: the parameters' compute dtype; `shard`: the group each unit is split
        over; `replicas`: every rank holding the same model (initial values are broadcast
        over it); `frozen`: parameters held but not trained (those under the persistence
        threshold stay whole, outside ZeRO); `secondary`: hpZ's secondary partition group
        (policy.plus_plus)."""
        world = shard.size
        prefetch = policy.prefetch
        threshold = prefetch.persistence_threshold
        persistent = [(n, p, g) for n, p, g in named if p.numel() < threshold]
        partitioned = {id(p): (n, p, g) for n, p, g in named if p.numel() >= threshold}
        held_frozen = {id(p): (n, p, 0) for n, p in frozen if p.numel() >= threshold}
        leaves = leaf_modules(model, policy.leaf_modules)
        inside = {below for leaf in leaves for below in list(leaf.modules())[1:]}
        self.module_units_list = _module_units(model, partitioned, world, align, first_index=0, leaves=leaves,
                                               inside=inside)
        self.frozen_units = _module_units(
            model, held_frozen, world, align, first_index=len(self.module_units_list) + len(persistent),
            leaves=leaves, inside=inside,
        )
        unit_of = {
            id(slot.param): unit for unit in self.module_units_list + self.frozen_units for slot in unit.slots
        }
        module_units: dict[nn.Module, list[FlatUnit]] = {}
        for module in model.modules():
            if module in inside:
                continue
            units = list({id(u): u for p in _gathered_with(module, leaves) if (u := unit_of.get(id(p)))}.values())
            if units:
                module_units[module] = units

        self.sharded = ShardedParameters(
            self.module_units_list + self.frozen_units, dtype, device, shard, ledger, policy.offload_param,
            policy.plus_plus, secondary,
            spare_bytes_between_passes=prefetch.prefetch_bucket_size * torch.empty((), dtype=dtype).element_size(),
        )
        self.replicas = replicas
        _materialize_and_shard(model, self.sharded, unit_of, replicas, device, param_init_fn or _default_init)
        persistent_units = pack_units(
            reversed(persistent), policy.reduce_bucket_size, world, align,
            first_index=len(self.module_units_list),
        )
        self.replicated = ReplicatedParameters(
            persistent_units, dtype, device, shard, replicas, ledger, policy.allgather_bucket_size
        )
        self.replicated.broadcast_initial()
        self.units = self.module_units_list + persistent_units
        self.schedule = GatherSchedule(model, module_units, self.sharded, shard, prefetch=prefetch,
                                       frozen={unit.index for unit in self.frozen_units})

    def _is_partitioned(self, unit: FlatUnit) -> bool:
        return unit.index in self.sharded.flats

    def owned_chunk(self, unit: FlatUnit) -> torch.Tensor:
        if self._is_partitioned(unit):
            return self.sharded.owned_chunk(unit)
        return self.replicated.owned_chunk(unit)

    def after_update(self) -> None:
        """Partitioned units are read from their shards at the next gather (a paging home
        writes the rewritten shards out first); only the persistent ones are all-gathered now."""
        self.sharded.flush(rewritten=True)
        self.replicated.after_update()

    def settle(self) -> None:
        self.sharded.flush()

    def transfers(self) -> dict[str, int]:
        return self.sharded.home.transfers()

    def close(self) -> None:
        self.sharded.home.close()
        self.sharded.buffers.release()

    def connect(self, reducer) -> None:
        """Backward frees a unit once its gradients are reduced, and points its `.grad`
        straight at a reduce bucket just before the unit's backward runs."""
        reducer.unit_ready_callbacks.append(self.schedule.on_grads_ready)
        self.schedule.backward_use_callbacks.append(reducer.prepare_unit)

    def end_backward(self) -> None:
        self.schedule.end_backward()
        self.sharded.home.finish_reads()  # the step may write into any shard next
        self.sharded.buffers.end_pass()
        # over shared memory, the step writes where peers still in their backward read
        self.sharded.await_readers("the end of backward")

    def await_readers(self) -> None:
        self.sharded.await_readers("rewriting the shards")

    def abort_pass(self) -> None:
        self.schedule.abort()
        self.sharded.home.finish_reads()
        self.sharded.buffers.end_pass()

    def release_gathered(self) -> None:
        for unit in self.sharded.units:
            self.sharded.free(unit)
        self.sharded.buffers.release()

    def acquire(self, units: list[FlatUnit]) -> None:
        for unit in units:
            if self._is_partitioned(unit):
                self.sharded.acquire(unit)

    def release(self, units: list[FlatUnit]) -> None:
        for unit in units:
            if self._is_partitioned(unit) and self.sharded.release_use(unit) == 0:
                self.sharded.free(unit)
        self.sharded.buffers.end_pass()  # a whole model gathered for generation leaves no spares behind

    def broadcast_edits(self, unit: FlatUnit, source: int) -> None:
        if not self._is_partitioned(unit):
            self.replicated.broadcast_edits(unit, source)
            return
        self.replicas.broadcast(self.sharded.full_buffer(unit), source, f"edited parameters of {unit}")
        self.sharded.take_shard_from_full(unit)

    def persistent_numel(self) -> int:
        return sum(unit.numel for unit in self.replicated.units)

    def remove_hooks(self) -> None:
        self.schedule.remove_hooks()


def _gathered_with(module: nn.Module, leaves: set[nn.Module]) -> Iterator[nn.Parameter]:
    """The parameters gathered when `module` is entered: its own, or, for a leaf module
    (leaf_modules.py), every parameter below it."""
    return module.parameters(recurse=module in leaves)


def _module_units(
    model: nn.Module, held: dict[int, tuple[str, nn.Parameter, int]], world: int, align: int, first_index: int,
    *, leaves: set[nn.Module], inside: set[nn.Module],
) -> list[FlatUnit]:
    """One unit per module that first owns some of `held`, numbered in reverse module order;
    a leaf module owns everything below it, and the modules `inside` leaves own nothing."""
    owners: list[tuple[str, list[tuple[str, nn.Parameter, int]]]] = []
    claimed: set[int] = set()
    for module_name, module in model.named_modules():
        if module in inside:
            continue
        own = [held[id(p)] for p in _gathered_with(module, leaves) if id(p) in held and id(p) not in claimed]
        claimed.update(id(entry[1]) for entry in own)
        if own:
            owners.append((module_name or "<root>", own))
    return [
        make_unit(first_index + index, own, world, align, label=name)
        for index, (name, own) in enumerate(reversed(owners))
    ]


def _materialize_and_shard(
    model: nn.Module,
    sharded: ShardedParameters,
    unit_of: dict[int, FlatUnit],
    comm: Communicator,
    device: torch.device,
    param_init_fn: Callable[[nn.Module], None],
) -> None:
    """Give every partitioned unit its shard; meta modules are built one at a time.

    A model with meta tensors is initialised from a seed rank 0 reads off the caller's
    CPU stream without advancing it, so initial weights follow the caller's
    `torch.manual_seed`, while every generator the caller sees (CPU and CUDA) is left
    exactly where plain PyTorch would leave it: a script's later draws, its data order or
    a GAN's noise, must not depend on the ZeRO stage (base/random_state.py)."""
    has_meta = any(t.is_meta for t in chain(model.parameters(), model.buffers()))
    seed = 0
    if has_meta:  # every rank has the same model (checked at start-up), so all or none broadcast
        with torch.random.fork_rng(devices=[]):  # a peek: the caller's stream does not advance
            drawn = torch.randint(0, 2**62, (1,), dtype=torch.int64)
        drawn = drawn.to(device)  # the replicas group may be NCCL's, which moves device tensors only
        comm.broadcast(drawn, 0, "initialisation seed")
        seed = int(drawn.item())
        _move_materialised(model, device)
    done: set[int] = set()
    with seeded_rng(seed, device):
        for module in model.modules():
            direct = list(module.parameters(recurse=False))
            meta_buffers = [name for name, b in module.named_buffers(recurse=False) if b.is_meta]
            if meta_buffers or any(p.is_meta for p in direct):
                for param in direct:
                    if param.is_meta:  # same Python object, so optimizers and ties still hold it
                        real = torch.empty(param.shape, dtype=param.dtype, device=device)
                        torch.utils.swap_tensors(param, nn.Parameter(real, param.requires_grad))
                for name in meta_buffers:
                    module._buffers[name] = torch.empty_like(module._buffers[name], device=device)
                with torch.no_grad():
                    param_init_fn(module)
            elif direct:
                for param in direct:
                    if id(param) in unit_of and id(param) not in done:
                        comm.broadcast(param.data, 0, "initial parameters")
            for param in direct:
                unit = unit_of.get(id(param))
                if unit is not None and unit.index not in done:
                    done.add(unit.index)
                    sharded.take_shard_from_full(unit)


def _move_materialised(model: nn.Module, device: torch.device) -> None:
    """A model built partly on the meta device cannot be moved by `model.to` (a meta
    tensor has no data to copy), so the engine leaves it where it was built; its real
    parameters and buffers move to `device` here, before any is broadcast (NCCL moves
    device tensors only) or used by forward."""
    with torch.no_grad():
        for module in model.modules():
            for param in module.parameters(recurse=False):
                if not param.is_meta and param.device != device:
                    param.data = param.data.to(device)
            for name, buffer in module.named_buffers(recurse=False):
                if not buffer.is_meta and buffer.device != device:
                    module._buffers[name] = buffer.to(device)
