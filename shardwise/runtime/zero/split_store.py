"""Partial optimizer offload (`offload_optimizer.ratio` < 1, DeepSpeed's ZeRO-Offload++
"Twin-Flow"): a fraction `ratio` of this rank's fp32 partition is updated in the host or
NVMe tier and the rest stays in the device tier and is updated there.

Why: full offload moves every optimizer step to the CPU, which is slow when the model
nearly fits; keeping part of the partition on the device lets the accelerator update that
part while the CPU updates the other, using the device memory that is left.

How the partition is cut: in store order (the units' order, as the sub-groups are), the
leading units stay on the device and the trailing ones are offloaded. The boundary is the
unit boundary nearest to (1 - ratio) of the partition (ties: more offloaded). It falls
between units, not inside one, because a unit's reduced gradient lands in one buffer (the
reducer hands each unit's chunk to one place), and so sub-groups never straddle tiers,
as in DeepSpeed where each sub-group is assigned to one device. With a single unit, or a
ratio near 0 or 1, one side may be empty: then the store is just the other tier's.

The split store composes a `DeviceShardStore` over the leading units and a host or NVMe
store over the trailing ones, and routes each call by unit or by segment. The optimizer
sees one list of segments and steps one sub-group at a time, so the update of every
element is the same as with either tier alone: fp32 training gives identical weights.
"""

from __future__ import annotations

from collections import Counter
from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Iterator

import torch

from shardwise.runtime.zero.host_store import HostShardStore
from shardwise.runtime.zero.nvme_store import NvmeShardStore
from shardwise.runtime.zero.layout import FlatUnit
from shardwise.runtime.zero.policy import OffloadPolicy
from shardwise.runtime.zero.shard_store import DeviceShardStore, SegmentState, ShardStore, StoreSpec


def device_unit_count(partitions: list[int], ratio: float) -> int:
    """How many leading units stay on the device: the prefix whose elements are nearest to
    (1 - ratio) of the total (ties: the shorter prefix, so more is offloaded)."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"offload_optimizer.ratio must be in [0, 1], got {ratio}")
    target = (1.0 - ratio) * sum(partitions)
    prefix, best, best_distance = 0, 0, float(abs(target))
    for count, numel in enumerate(partitions, start=1):
        prefix += numel
        if abs(prefix - target) < best_distance:
            best, best_distance = count, abs(prefix - target)
    return best


class SplitShardStore(ShardStore):
    """The device tier for `device.units`, an offloaded tier for `offloaded.units`."""

    def __init__(self, device: ShardStore, offloaded: ShardStore, per_parameter: bool):
        self.device, self.offloaded = device, offloaded
        self.tier, self.state_tier = offloaded.tier, offloaded.state_tier
        self.units = device.units + offloaded.units
        self.chunk = device.chunk
        self.keeps_full_gradients = device.keeps_full_gradients
        self.segments = device.segments + offloaded.segments
        self._owner_of_unit = {unit.index: store for store in (device, offloaded) for unit in store.units}
        self._owner_of_segment = {id(s): store for store in (device, offloaded) for s in store.segments}
        # a whole-parameter optimizer steps every segment at once (shard_store.py), across tiers
        self.sub_groups = [self.segments] if per_parameter else device.sub_groups + offloaded.sub_groups
        self._sub_group_index = {id(s): i for i, group in enumerate(self.sub_groups) for s in group}

    def _parts(self, sub_group: list[SegmentState]) -> list[tuple[ShardStore, list[SegmentState]]]:
        """`sub_group`'s segments by the store that holds them (each part is one of that
        store's sub-groups)."""
        parts = [(store, [s for s in sub_group if self._owner_of_segment[id(s)] is store])
                 for store in (self.device, self.offloaded)]
        return [(store, part) for store, part in parts if part]

    # -- gradients: by unit --------------------------------------------------------------------
    def gradient(self, unit: FlatUnit) -> torch.Tensor:
        return self._owner_of_unit[unit.index].gradient(unit)

    def full_gradient(self, unit: FlatUnit) -> torch.Tensor | None:
        return self._owner_of_unit[unit.index].full_gradient(unit)

    def gradients(self) -> list[torch.Tensor]:
        return self.device.gradients() + self.offloaded.gradients()

    def receive_gradient(self, unit: FlatUnit, reduced: torch.Tensor) -> Any:
        return self._owner_of_unit[unit.index].receive_gradient(unit, reduced)

    def summing_target(self, unit: FlatUnit) -> torch.Tensor | None:
        return self._owner_of_unit[unit.index].summing_target(unit)

    def start_window(self) -> None:
        self.device.start_window()
        self.offloaded.start_window()

    def zero_gradients(self) -> None:
        self.device.zero_gradients()
        self.offloaded.zero_gradients()

    # -- masters and optimizer state: by segment ---------------------------------------------------
    @contextmanager
    def resident(self, sub_group: list[SegmentState]) -> Iterator[list[SegmentState]]:
        with ExitStack() as stack:
            for store, part in self._parts(sub_group):
                stack.enter_context(store.resident(part))
            yield sub_group

    def adopt_state(self, sub_group: list[SegmentState], state: dict) -> None:
        for store, part in self._parts(sub_group):
            store.adopt_state(part, state)

    def publish(self, sub_group: list[SegmentState] | None = None) -> None:
        if sub_group is None:
            self.device.publish()
            self.offloaded.publish()
            return
        for store, part in self._parts(sub_group):
            store.publish(part)

    def refresh_master(self, unit: FlatUnit) -> None:
        self._owner_of_unit[unit.index].refresh_master(unit)

    def master_bytes(self) -> int:
        return self.device.master_bytes() + self.offloaded.master_bytes()

    def state_bytes_by_tier(self, state_bytes: Callable[[SegmentState], int]) -> dict[str, int]:
        total: Counter = Counter(self.device.state_bytes_by_tier(state_bytes))
        total.update(self.offloaded.state_bytes_by_tier(state_bytes))
        return dict(total)

    def transfers(self) -> dict[str, int]:
        return self.offloaded.transfers()

    def close(self) -> None:
        self.offloaded.close()


def make_split_store(spec: StoreSpec, offload: OffloadPolicy, rank: int) -> ShardStore:
    """The store for `offload.ratio` < 1 of an offloaded optimizer ("cpu" or "nvme")."""
    units = spec.units
    count = device_unit_count([unit.chunk_numel for unit in units], offload.ratio)

    def store_for(tier_units: list[FlatUnit], tier: str) -> ShardStore:
        tier_spec = spec.with_units(tier_units)
        if tier == "device":
            return DeviceShardStore(tier_spec)
        if tier == "cpu":
            return HostShardStore(tier_spec, pin_memory=offload.pin_memory)
        return NvmeShardStore(tier_spec, offload=offload, rank=rank)

    if count == len(units):
        return store_for(units, "device")
    if count == 0:
        return store_for(units, offload.device)
    return SplitShardStore(store_for(units[:count], "device"), store_for(units[count:], offload.device),
                           spec.per_parameter)
