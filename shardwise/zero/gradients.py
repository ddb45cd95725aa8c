"""Gradient reduction during backward (C1 overlap, C3 reduce-scatter, C4 per-module units).

A hook on every parameter fires once its gradient for this backward is complete. When all
parameters of a unit have reported, the unit's gradient is reduced asynchronously while
backward keeps computing earlier layers:

- stage 0: all-reduce the unit's slice of a full gradient buffer (every rank keeps all);
- stage 1: reduce-scatter that slice in place (the full buffer stays, as ZeRO-1 keeps it);
- stages 2-3: copy gradients into a transient bucket, reduce-scatter it and add this rank's
  chunk into a gradient *shard*; the bucket goes back to a small pool (constant memory).

Units are launched strictly in index order, even if they become ready out of order. That
keeps the sequence of collectives identical on every rank, so a parameter that is unused
on one rank but not another (data-dependent control flow) delays a launch instead of
pairing the wrong collectives. Gradients are averaged over ranks (pre-divided by N).

Reductions that need transient memory (buckets, reduce-scatter receive buffers: every
stage but 0) are double-buffered: one unit fills while MAX_IN_FLIGHT (one) reduces, and
launching another first finishes the oldest. Communication still overlaps backward, and
the transient memory stays a constant number of units, whatever the model size. Stage 0
all-reduces in place, so its reductions are not limited.

Stages 0-1 accumulate micro-batches locally and reduce only at the accumulation boundary.
A window starts with `.grad` unset (nothing is zeroed): a parameter's first gradient is
copied into the buffer and `.grad` becomes a view of it, so autograd accumulates later
micro-batches in place; parameters that got no gradient in the window are zeroed before
their unit is reduced.
Stages 2-3 must reduce every micro-batch, since they only keep a shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from shardwise.accounting import MemoryLedger, tensor_bytes
from shardwise.distributed.collectives import Communicator, PendingCollective
from shardwise.zero.layout import FlatUnit, ParamSlot


MAX_IN_FLIGHT = 1


@dataclass
class _Launched:
    unit: FlatUnit
    pending: PendingCollective
    finalize: Callable[[], None]


class GradientReducer:
    def __init__(
        self,
        units: list[FlatUnit],
        stage: int,
        comm: Communicator,
        ledger: MemoryLedger,
        grad_dtype: torch.dtype,
        comm_dtype: torch.dtype,
        device: torch.device,
        overlap: bool = True,
        reduce_scatter: bool = True,
    ):
        """`overlap=False` waits for each reduction right after launching it;
        `reduce_scatter=False` reduces partitioned gradients with all-reduce instead."""
        if [unit.index for unit in units] != list(range(len(units))):
            raise ValueError("units must be numbered 0..n-1 in launch order")
        self.units = units
        self.stage = stage
        self.comm = comm
        self.ledger = ledger
        self.grad_dtype = grad_dtype
        self.comm_dtype = comm_dtype
        self.device = device
        self.overlap = overlap
        self.use_reduce_scatter = reduce_scatter
        self.keeps_full_grads = stage <= 1
        self.chunk = 0 if stage == 0 else comm.rank
        self.unit_ready_callbacks: list[Callable[[FlatUnit], None]] = []

        if self.keeps_full_grads:
            sizes = [unit.padded_numel for unit in units]
        else:
            sizes = [unit.chunk_numel for unit in units]
        self.storage = torch.zeros(sum(sizes), dtype=grad_dtype, device=device)
        ledger.hold("grads", tensor_bytes(self.storage))
        self._unit_grads = list(torch.split(self.storage, sizes))
        self._slot_views: dict[int, torch.Tensor] = {}
        if self.keeps_full_grads:
            for unit, flat in zip(units, self._unit_grads):
                for slot in unit.slots:
                    view = flat[slot.offset : slot.offset + slot.numel].view(slot.shape)
                    self._slot_views[id(slot)] = view
        self._written: list[set[int]] = [set() for _ in units]  # stages 0-1, this window
        for unit in units:
            for slot in unit.slots:
                slot.param.grad = None  # a gradient from before initialize() is not ours

        self._free_buckets: list[torch.Tensor] = []
        self._bucket_count = 0
        self._bucket_numel = max(unit.padded_numel for unit in units)
        self._hooks = [
            slot.param.register_post_accumulate_grad_hook(self._make_hook(unit, slot))
            for unit in units
            for slot in unit.slots
        ]
        self._reducing = False
        self._reset_backward_state()

    # -- what the optimizer reads -------------------------------------------------------
    def owned_grad(self, unit: FlatUnit) -> torch.Tensor:
        """This rank's reduced gradient for `unit` (stage 0: the whole unit)."""
        grads = self._unit_grads[unit.index]
        if not self.keeps_full_grads:
            return grads
        lo, hi = unit.chunk_bounds(self.chunk)
        return grads[lo:hi]

    def zero_grads(self) -> None:
        """Start a new accumulation window (after the optimizer step)."""
        if not self.keeps_full_grads:
            self.storage.zero_()
            return
        for unit in self.units:
            for slot in unit.slots:
                slot.param.grad = None
        self._written = [set() for _ in self.units]

    # -- backward ----------------------------------------------------------------------
    def _reset_backward_state(self) -> None:
        self._seen: list[set[int]] = [set() for _ in self.units]
        self._buckets: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # unit -> (buffer, bucket)
        self._ready = [False] * len(self.units)
        self._next_launch = 0
        self._launched: list[_Launched] = []

    def begin_backward(self, reduce: bool) -> None:
        """`reduce`: this backward ends an accumulation window (always true for stage >= 2)."""
        self._reducing = reduce or not self.keeps_full_grads
        self._reset_backward_state()

    def _make_hook(self, unit: FlatUnit, slot: ParamSlot) -> Callable[[torch.Tensor], None]:
        def on_gradient_ready(param: torch.Tensor) -> None:
            self._accept_gradient(unit, slot, param)

        return on_gradient_ready

    def _accept_gradient(self, unit: FlatUnit, slot: ParamSlot, param: torch.Tensor) -> None:
        seen = self._seen[unit.index]
        if self._reducing and self._next_launch > unit.index:
            raise RuntimeError(
                f"parameter {slot.name} received a gradient after its {unit} was already "
                "reduced in this backward. Call engine.backward() once per micro-batch and use "
                "non-reentrant activation checkpointing (use_reentrant=False)."
            )
        if self.keeps_full_grads:
            view = self._slot_views[id(slot)]
            written = self._written[unit.index]
            if id(slot) not in written:
                view.copy_(param.grad)
                written.add(id(slot))
            elif param.grad is not view:  # someone reset .grad; fold it back into the buffer
                view.add_(param.grad)
            param.grad = view
        else:
            if unit.index not in self._buckets:
                self.prepare_unit(unit)  # later parameters of the unit accumulate in place
            target = self._bucket_for(unit)[slot.offset : slot.offset + slot.numel]
            if param.grad.data_ptr() != target.data_ptr():  # not accumulated in place
                source = param.grad.reshape(-1)
                target.add_(source) if id(slot) in seen else target.copy_(source)
            param.grad = None
        seen.add(id(slot))
        if self._reducing and len(seen) == len(unit.slots):
            self._mark_ready(unit)

    def _mark_ready(self, unit: FlatUnit) -> None:
        self._ready[unit.index] = True
        for callback in self.unit_ready_callbacks:
            callback(unit)
        while self._next_launch < len(self.units) and self._ready[self._next_launch]:
            self._launch(self.units[self._next_launch])
            self._next_launch += 1

    def end_backward(self) -> None:
        """Reduce units whose parameters got no gradient, in order, and wait for all."""
        if self._reducing:
            for unit in self.units[self._next_launch :]:
                if not self._ready[unit.index]:
                    self._fill_missing(unit)
                    self._mark_ready(unit)
        while self._launched:
            self._complete_oldest()

    def _fill_missing(self, unit: FlatUnit) -> None:
        if self.keeps_full_grads:
            for slot in unit.slots:
                if id(slot) not in self._written[unit.index]:
                    self._slot_views[id(slot)].zero_()
            return
        bucket = self._bucket_for(unit)
        for slot in unit.slots:
            if id(slot) not in self._seen[unit.index]:
                bucket[slot.offset : slot.offset + slot.numel].zero_()

    def prepare_unit(self, unit: FlatUnit) -> None:
        """Point the `.grad` of the unit's parameters that have none yet at a zeroed
        bucket, so autograd accumulates straight into it: no full-size gradient tensor
        and no copy. Stage 3 calls this just before the unit's backward; stage 2 when the
        unit's first gradient arrives."""
        if self.keeps_full_grads or unit.index in self._buckets:
            return
        bucket = self._bucket_for(unit)
        if self.comm_dtype != self.grad_dtype:
            return  # .grad must have the parameter's dtype
        bucket[: unit.numel].zero_()
        for slot in unit.slots:
            if slot.param.grad is None and id(slot) not in self._seen[unit.index]:
                slot.param.grad = bucket[slot.offset : slot.offset + slot.numel].view(slot.shape)

    # -- buckets (stages 2-3) ----------------------------------------------------------
    def _bucket_for(self, unit: FlatUnit) -> torch.Tensor:
        """The unit's bucket, taken from the pool on first use in this backward.

        The pool grows to MAX_IN_FLIGHT + 1 buckets (one filling, the rest in flight);
        beyond that, an empty pool waits for the oldest reduction to return its bucket.
        It grows further only when nothing is in flight (units filling out of order).
        """
        if unit.index in self._buckets:
            return self._buckets[unit.index][1]
        if not self._free_buckets and self._launched and self._bucket_count > MAX_IN_FLIGHT:
            self._complete_oldest()
        if self._free_buckets:
            buffer = self._free_buckets.pop()
        else:
            buffer = torch.empty(self._bucket_numel, dtype=self.comm_dtype, device=self.device)
            self.ledger.hold("buffers", tensor_bytes(buffer))
            self._bucket_count += 1
        bucket = buffer[: unit.padded_numel]
        bucket[unit.numel :].zero_()
        self._buckets[unit.index] = (buffer, bucket)
        return bucket

    # -- collectives ---------------------------------------------------------------------
    def _launch(self, unit: FlatUnit) -> None:
        while self.stage > 0 and len(self._launched) >= MAX_IN_FLIGHT:
            self._complete_oldest()
        world = self.comm.world_size
        what = f"gradients of {unit}"
        if self.keeps_full_grads:
            grads = self._unit_grads[unit.index]
            if self.comm_dtype == self.grad_dtype:
                wire = grads
            else:
                wire = grads.to(self.comm_dtype)
                self.ledger.hold("buffers", tensor_bytes(wire))
            wire.div_(world)
            if self.stage == 0:
                pending = self.comm.all_reduce(wire, what)
                target, source = grads, wire
            else:
                lo, hi = unit.chunk_bounds(self.chunk)
                pending = self._reduce_to_owner(wire, lo, hi, what)
                target, source = grads[lo:hi], wire[lo:hi]

            def finalize() -> None:
                if source.data_ptr() != target.data_ptr():
                    target.copy_(source)
                    self.ledger.release("buffers", tensor_bytes(wire))

        else:
            buffer, bucket = self._buckets.pop(unit.index)
            for slot in unit.slots:  # prepared but never reached by a gradient
                slot.param.grad = None
            bucket.div_(world)
            lo, hi = unit.chunk_bounds(self.chunk)
            pending = self._reduce_to_owner(bucket, lo, hi, what)
            shard = self._unit_grads[unit.index]

            def finalize() -> None:
                shard.add_(bucket[lo:hi])
                self._free_buckets.append(buffer)

        self._launched.append(_Launched(unit, pending, finalize))
        if not self.overlap:
            self._complete_oldest()

    def _reduce_to_owner(self, full: torch.Tensor, lo: int, hi: int, what: str) -> PendingCollective:
        """Sum `full` over ranks so that this rank's [lo, hi) holds the result."""
        if self.use_reduce_scatter:
            return self.comm.reduce_scatter(full[lo:hi], full, what)
        return self.comm.all_reduce(full, what)

    def _complete_oldest(self) -> None:
        launched = self._launched.pop(0)
        launched.pending.wait()
        launched.finalize()

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
