"""Where this rank's share of the training state lives: one owner for the fp32 masters, the
gradient buffers the reducer fills, and the sub-groups the optimizer steps through.

Before this existed, masters, gradient shards, parameter shards and optimizer state
belonged to four objects and nothing knew which memory they sat in. A store has one
*tier* (where its bytes live) and one interface, so ZeRO-Offload (host memory) and
ZeRO-Infinity (NVMe files) are further stores, not further branches in the engine:

    segments              fp32 master runs of this rank's chunks, with their gradients
    gradient(unit)        the reduced gradient of that chunk (what the optimizer reads)
    full_gradient(unit)   stages 0-1: the whole unit's accumulation buffer (None otherwise)
    receive_gradient(unit, reduced)
                          the reducer hands over this rank's reduced chunk of `unit`: added
                          into `gradient(unit)` (stages 2-3 every micro-batch), or, when it
                          already is that memory (stages 0-1 on the device), nothing to do;
                          returns None, or the event after which `reduced` may be written
                          again (a host tier's copy still reading it)
    summing_target(unit)  `gradient(unit)` where receiving a chunk only adds it there (None
                          for a host tier): a group of one sums micro-batches in it directly
    sub_groups            segments in pieces of about `sub_group_size` elements
    resident(sub_group)   the sub-group's masters and optimizer state are in memory for the
                          duration of the block (a paging tier reads them in and writes back)
    publish(sub_group)    copy updated masters into the parameters' owned chunks

`DeviceShardStore` is the device tier; shardwise/runtime/zero/ holds the host and NVMe tiers.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator

import torch

from shardwise.runtime.accounting import MemoryLedger, tensor_bytes
from shardwise.runtime.zero.layout import FlatUnit, OwnedPiece
from shardwise.runtime.zero.strategy import ParameterStrategy


@dataclass(frozen=True)
class StoreSpec:
    """What every store is built from, whatever its tier (zero/apply.py fills it from the
    policy; a split store gives each tier its own `units`)."""

    units: list[FlatUnit]
    chunk: int  # which chunk of every unit this rank owns (its shard-group rank)
    strategy: ParameterStrategy  # where the masters are copied from and published to
    grad_dtype: torch.dtype  # what the gradient buffers sum micro-batches in (PrecisionPolicy.accumulation_dtype)
    keeps_full_gradients: bool  # stages 0-1: the whole unit's accumulation buffer
    sub_group_size: int  # elements the optimizer steps (and a paging tier holds) at once
    ledger: MemoryLedger
    device: torch.device  # where the model computes and gradients are reduced (shards may live elsewhere)
    per_parameter: bool = False  # one segment per parameter piece (optimizers of whole parameters)
    master_dtype: torch.dtype = torch.float32  # the parameters' own dtype: trained in place, no copy
    param_dtype: torch.dtype = torch.float32  # the parameters' (what a publish copies back per element)

    def with_units(self, units: list[FlatUnit]) -> "StoreSpec":
        return replace(self, units=units)


@dataclass(frozen=True)
class SegmentState:
    """A run of this rank's chunk of one unit that belongs to one optimizer param group."""

    unit: int  # FlatUnit.index
    start: int  # [start, stop) inside this rank's chunk of the unit
    stop: int
    group: int
    master: torch.Tensor  # fp32, trained by the optimizer
    grad: torch.Tensor  # reduced gradient in the accumulation dtype (a view, never copied here)
    piece: OwnedPiece | None = None  # per-parameter segments: the parameter piece it is

    @property
    def numel(self) -> int:
        return self.stop - self.start


class ShardStore:
    """What every tier shares: how this rank's chunks are cut into segments and sub-groups,
    and the lookups the reducer, optimizer and checkpoints use. A tier allocates its
    buffers and hands them to `_organise`."""

    tier = "device"  # where the gradient partition and masters live
    state_tier = "device"  # where optimizer state and masters are counted

    def _organise(
        self,
        spec: StoreSpec,
        masters: list[torch.Tensor],
        full_grads: list[torch.Tensor] | None,
        grads: list[torch.Tensor],
    ) -> None:
        """`spec.per_parameter`: one segment per owned parameter piece, for optimizers whose
        update depends on whole parameters (they also step all segments at once, since each
        step reduces statistics over the shard group and every rank must take part once).
        Parameter chunks are asked of `strategy` at each use, never kept: a paging home
        (NVMe, offload/param_home.py) may write a chunk out and give its memory back
        between two uses."""
        units, chunk, strategy = spec.units, spec.chunk, spec.strategy
        self.units = units
        self.chunk = chunk
        self.keeps_full_gradients = full_grads is not None
        self._strategy = strategy
        self._masters = masters
        self._full_grads = full_grads
        self._grads = grads
        self._position = {unit.index: position for position, unit in enumerate(units)}
        if spec.per_parameter:
            self.segments = [
                SegmentState(unit.index, p.chunk_offset, p.chunk_offset + p.numel, p.slot.group,
                             master[p.chunk_offset : p.chunk_offset + p.numel],
                             grad[p.chunk_offset : p.chunk_offset + p.numel], p)
                for unit, master, grad in zip(units, masters, grads)
                for p in unit.owned_pieces(chunk)
            ]
            self.sub_groups = [self.segments]
        else:
            self.segments = [
                SegmentState(unit.index, segment.start, segment.stop, segment.group,
                             master[segment.start : segment.stop], grad[segment.start : segment.stop])
                for unit, master, grad in zip(units, masters, grads)
                for segment in unit.segments(chunk)
            ]
            self.sub_groups = _split_sub_groups(self.segments, spec.sub_group_size)
            self.segments = [segment for group in self.sub_groups for segment in group]
        self._sub_group_index = {id(seg): i for i, group in enumerate(self.sub_groups) for seg in group}

    # -- what the reducer, optimizer and checkpoints read ------------------------------------
    def gradient(self, unit: FlatUnit) -> torch.Tensor:
        return self._grads[self._position[unit.index]]

    def master_chunk(self, unit: FlatUnit) -> torch.Tensor:
        """The fp32 masters of this rank's chunk of `unit` (memory-resident tiers)."""
        return self._masters[self._position[unit.index]]

    def full_gradient(self, unit: FlatUnit) -> torch.Tensor | None:
        return self._full_grads[self._position[unit.index]] if self._full_grads is not None else None

    def gradients(self) -> list[torch.Tensor]:
        """This rank's reduced gradient chunks, one per unit."""
        return self._grads

    def receive_gradient(self, unit: FlatUnit, reduced: torch.Tensor) -> Any:
        target = self.gradient(unit)
        if reduced.data_ptr() != target.data_ptr():
            target.add_(reduced)
        return None

    def summing_target(self, unit: FlatUnit) -> torch.Tensor | None:
        """The memory `receive_gradient` adds `unit`'s reduced chunk into when that is all it
        does (a memory-resident tier), else None (a tier that copies the chunk elsewhere): a
        reducer with nothing to reduce lets autograd sum each micro-batch there itself."""
        return self.gradient(unit)

    @contextmanager
    def resident(self, sub_group: list[SegmentState]) -> Iterator[list[SegmentState]]:
        """Device and host tiers hold everything in memory already."""
        yield sub_group

    def adopt_state(self, sub_group: list[SegmentState], state: dict) -> None:
        """The optimizer may have created state for `sub_group` (its first step, a load): a
        paging tier moves it into its own buffers; memory-resident tiers leave it."""

    def close(self) -> None:
        """Release files and threads (a paging tier); memory-resident tiers hold none."""

    def transfers(self) -> dict[str, int]:
        """Bytes moved between tiers since start-up ({} when everything stays on the device)."""
        return {}

    def state_bytes_by_tier(self, state_bytes: Callable[[SegmentState], int]) -> dict[str, int]:
        """Bytes of the fp32 masters and optimizer state per tier they live in, with
        `state_bytes(segment)` the optimizer state of one segment (a split store holds
        some on the device and some offloaded: offload/split_store.py)."""
        return {self.state_tier: self.master_bytes() + sum(state_bytes(s) for s in self.segments)}

    def sub_group_index(self, segment: SegmentState) -> int:
        return self._sub_group_index[id(segment)]

    def sub_group_of(self, segment: SegmentState) -> list[SegmentState]:
        return self.sub_groups[self._sub_group_index[id(segment)]]

    # -- masters <-> parameters -----------------------------------------------------------------
    def publish(self, sub_group: list[SegmentState] | None = None) -> None:
        """Updated masters of `sub_group` (None: all, each made resident in turn) become the
        owned chunks of the parameters (16-bit copies)."""
        if sub_group is None:
            for group in self.sub_groups:
                with self.resident(group):
                    self.publish(group)
            return
        for segment in sub_group:
            param = self._param_chunk(segment.unit)[segment.start : segment.stop]
            if param.data_ptr() != segment.master.data_ptr():
                param.copy_(segment.master, non_blocking=True)

    def refresh_master(self, unit: FlatUnit) -> None:
        """The parameter chunk of `unit` was edited (gathered_parameters, a checkpoint load
        of 16-bit values): take the master from it."""
        for segment in (s for s in self.segments if s.unit == unit.index):
            with self.resident(self.sub_group_of(segment)):
                param = self._param_chunk(unit.index)[segment.start : segment.stop]
                if segment.master.data_ptr() != param.data_ptr():
                    segment.master.copy_(param)

    def _param_chunk(self, unit_index: int) -> torch.Tensor:
        """This rank's parameter chunk of a unit, valid until the strategy is next asked."""
        return self._strategy.owned_chunk(self.units[self._position[unit_index]])


class DeviceShardStore(ShardStore):
    """Everything in the training device's memory, no paging. Mixed precision keeps a
    separate fp32 master copy; fp32 training, and bf16 training with bf16 masters, train the
    parameters' own chunks in place (K = 8 instead of 12 in fp32, 4 in bf16:
    docs/formulas.md#optimizer-state-bytes-k)."""

    def __init__(self, spec: StoreSpec):
        """Its parameter chunks are never paged (a paging home comes with an offloaded
        optimizer), so they can be held."""
        units, keeps_full_gradients = spec.units, spec.keeps_full_gradients
        param_chunks = [spec.strategy.owned_chunk(unit) for unit in units]
        device = param_chunks[0].device
        self.master_flat = None
        masters = param_chunks
        if param_chunks[0].dtype != spec.master_dtype:
            self.master_flat, masters = copy_into_flat(param_chunks, spec.master_dtype, device)
        sizes = [unit.padded_numel if keeps_full_gradients else unit.chunk_numel for unit in units]
        self.grad_flat = torch.zeros(sum(sizes), dtype=spec.grad_dtype, device=device)
        spec.ledger.hold("grads", tensor_bytes(self.grad_flat))
        unit_grads = list(torch.split(self.grad_flat, sizes))
        if keeps_full_gradients:
            grads = [full[slice(*unit.chunk_bounds(spec.chunk))] for unit, full in zip(units, unit_grads)]
        else:
            grads = unit_grads
        self._organise(spec, masters, unit_grads if keeps_full_gradients else None, grads)

    def start_window(self) -> None:
        """A new accumulation window: stages 2-3 zero their partition (stages 0-1 overwrite
        their buffer with each window's first gradients instead; gradients.py)."""
        if not self.keeps_full_gradients:
            self.grad_flat.zero_()

    def zero_gradients(self) -> None:
        """Drop every gradient held (a failed backward's window)."""
        self.grad_flat.zero_()

    def master_bytes(self) -> int:
        """Bytes of the separate fp32 copy (0 when the parameters are trained in place)."""
        return tensor_bytes(self.master_flat) if self.master_flat is not None else 0


def copy_into_flat(tensors: list[torch.Tensor], dtype: torch.dtype, device: torch.device,
            pin_memory: bool = False) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One flat buffer holding a copy of each tensor; returns it and the views."""
    sizes = [tensor.numel() for tensor in tensors]
    flat = torch.empty(sum(sizes), dtype=dtype, device=device, pin_memory=pin_memory)
    views = list(torch.split(flat, sizes))
    for view, tensor in zip(views, tensors):
        view.copy_(tensor)
    return flat, views


def _split_sub_groups(segments: list[SegmentState], sub_group_size: int) -> list[list[SegmentState]]:
    """Sub-groups of `sub_group_size` elements (the last one fewer). A segment that does
    not fit in what is left of the current sub-group is cut there, so a sub-group (what a
    paging tier holds in memory at once) is bounded by the setting, not by the largest
    parameter. 0: each segment (a flat unit's piece in one param group) a sub-group of its
    own, uncut, as DeepSpeed's 0 makes each parameter one."""
    if sub_group_size == 0:
        return [[segment] for segment in segments] or [[]]
    groups: list[list[SegmentState]] = [[]]
    room = sub_group_size
    for segment in segments:
        while segment.numel > room:
            if room:
                head, segment = _cut(segment, room)
                groups[-1].append(head)
            groups.append([])
            room = sub_group_size
        groups[-1].append(segment)
        room -= segment.numel
    return [group for group in groups if group] or [[]]


def _cut(segment: SegmentState, numel: int) -> tuple[SegmentState, SegmentState]:
    """The first `numel` elements of a segment, and the rest (per-element optimizers only)."""
    middle = segment.start + numel
    return (SegmentState(segment.unit, segment.start, middle, segment.group, segment.master[:numel],
                         segment.grad[:numel]),
            SegmentState(segment.unit, middle, segment.stop, segment.group, segment.master[numel:],
                         segment.grad[numel:]))
