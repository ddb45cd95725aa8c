"""Gradient reduction during backward (C1 overlap, C3 reduce-scatter, C4 per-module units).

A hook on every parameter fires once its gradient for this backward is complete. When all
parameters of a unit have reported, the unit's gradient is reduced asynchronously while
backward keeps computing earlier layers, in two hops:

1. within the *shard* group, to the rank that owns each chunk: reduce-scatter in place in
   the full gradient buffer (stage 1), or of a transient bucket whose reduced chunk is
   added into the store's gradient partition (stages 2-3; the bucket goes back to a small
   pool, so memory stays constant);
2. across the *replicate* group, an all-reduce of the owned chunk, once per accumulation
   window. Plain ZeRO 1-3 has no replicas (this hop does nothing); hybrid sharding
   (`mics_shard_size`) all-reduces a 1/N_shard slice across groups; stage 0 is the case of
   a shard group of one rank, so hop 1 does nothing and hop 2 all-reduces the whole unit.

Gradients are averaged over all replicas of the model: pre-divided by shard x replicate size
(summed, undivided, with the policy's `sum_gradients`).

Units are launched strictly in index order, even if they become ready out of order. That
keeps the sequence of collectives identical on every rank, so a parameter that is unused
on one rank but not another (data-dependent control flow) delays a launch instead of
pairing the wrong collectives.

Reductions that need transient memory (buckets, gloo reduce-scatter receive buffers) are
double-buffered: one unit fills while MAX_IN_FLIGHT (one) reduces, and launching another
first finishes the oldest. Stage 0 all-reduces in place, so its reductions are not limited.

A host tier (ZeRO-Offload) copies each reduced chunk to host memory on a side stream and
returns the copy's event (offload/gradient_copies.py): a bucket goes back to the pool with
it, and is written again only after the current stream has waited for it, a wait on the
device that leaves backward running. The full buffers of stages 0-1 need no such wait:
they are written again only after the host has waited for their copies (the step reads
every gradient for its norm first; a second backward sets the reduced chunks aside, which
reads them; a discarded window waits for the copies it drops).

A shard group of one at stages 2-3 (one rank, nothing to divide, the store's partition in
the gradients' dtype on this device) has nothing to reduce: the partition is the whole
unit, so `.grad` points straight into it and autograd sums every micro-batch there. A
bucket would cost a zeroing, a fill and an add into the partition per micro-batch (stage 3
on one GPU: about 8 bytes per parameter each time) for the same sums, added in the same
order.

Stages 0-1 accumulate micro-batches locally and reduce only at the accumulation boundary.
A window starts with `.grad` unset (nothing is zeroed): a parameter's first gradient is
copied into the buffer and `.grad` becomes a view of it, so autograd accumulates later
micro-batches in place; parameters that got no gradient in the window are zeroed before
their unit is reduced. Stages 2-3 must reduce every micro-batch, since they only keep a
partition.

fp32 accumulation beside 16-bit training (`accumulation_dtype` fp32, DeepSpeed's
`data_types.grad_accum_dtype`): the store's buffers are fp32, and autograd's gradient keeps
the parameter's dtype. Stages 0-1: `.grad` cannot be a view of an fp32 buffer, so each
micro-batch's gradient is added into it by the hook and released (DeepSpeed's BF16_Optimizer
and its stage-1 `grad_accum` do the same per parameter); at the boundary the buffer is cast
to the communication dtype for the reduce-scatter, as DeepSpeed casts its fp32 sums for its
boundary reduction, and the owned chunk is written back in fp32. Stages 2-3 reduce each micro-batch
from the bucket as before and the store adds the reduced chunk into its fp32 partition
(DeepSpeed's stage 2 and 3 likewise). In the training dtype nothing of this runs: `.grad`
is the buffer's view, with no copy.

ZeRO++'s qgZ (`plus_plus.quantized_gradients`, stage 3) replaces hop 1's reduce-scatter by
two all-to-alls carrying int4, inside the node then across nodes, summed in fp32
(distributed/quantized_collectives.py); the owned chunk it yields is the reduce-scatter's.

1-bit Adam / LAMB after their warm-up exchange compressed momentum instead
(optimizer_exchange.py): backward then only accumulates each rank's own gradients.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from shardwise.runtime.accounting import MemoryLedger, tensor_bytes
from shardwise.runtime.distributed.collectives import Communicator, PendingCollective
from shardwise.runtime.distributed.quantized_collectives import HierarchicalQuantizedReduceScatter
from shardwise.runtime.zero.layout import FlatUnit, ParamSlot
from shardwise.runtime.zero.optimizer_exchange import OptimizerExchangeMixin
from shardwise.runtime.zero.policy import ZeroPolicy
from shardwise.runtime.zero.shard_store import ShardStore

MAX_IN_FLIGHT = 1


@dataclass
class _Launched:
    unit: FlatUnit
    pending: PendingCollective
    finalize: Callable[[], None]  # may start the next hop


class UnusedParametersError(AssertionError):
    """Trainable parameters took no part in the loss while the configuration asks for every
    one to (`ignore_unused_parameters: false`). An AssertionError, as DeepSpeed raises it."""

    def __init__(self, names: list[str]):
        shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        super().__init__(
            f"{len(names)} trainable parameter(s) got no gradient in this accumulation window on any rank: {shown}. "
            "They took no part in producing the loss, and zero_optimization.ignore_unused_parameters is false "
            "(checked, as DeepSpeed does, at stages 1-2 with the optimizer offloaded to the CPU). Make every "
            "trainable parameter take part in the loss, freeze the unused ones (requires_grad=False), or set "
            "ignore_unused_parameters to true: their gradient then counts as zero")
        self.names = names


class GradientReducer(OptimizerExchangeMixin):
    def __init__(
        self,
        units: list[FlatUnit],
        policy: ZeroPolicy,
        *,
        grad_dtype: torch.dtype,
        accumulation_dtype: torch.dtype | None = None,
        comm_dtype: torch.dtype,
        store: ShardStore,
        shard: Communicator,
        replicate: Communicator,
        ledger: MemoryLedger,
        device: torch.device,
        hierarchy: tuple[Communicator | None, Communicator | None] = (None, None),
    ):
        """`grad_dtype`: what autograd gives (the parameters' dtype); `accumulation_dtype`:
        what the store's buffers sum micro-batches in (None: `grad_dtype`). `hierarchy`: the
        shard group's members on this node and at this rank's place on every node, qgZ's two
        hops (ZeRO++)."""
        if [unit.index for unit in units] != list(range(len(units))):
            raise ValueError("units must be numbered 0..n-1 in launch order")
        self.units = units
        self.store = store
        self.shard = shard
        self.replicate = replicate
        self.ledger = ledger
        self.grad_dtype = grad_dtype
        self.accumulation_dtype = accumulation_dtype or grad_dtype
        # `.grad` can be a view of a full buffer only in its own dtype: an fp32 sum of 16-bit
        # gradients takes each micro-batch's gradient in, and autograd's copy is released
        self._grads_are_views = self.accumulation_dtype == grad_dtype
        self.comm_dtype = comm_dtype
        self.device = device
        self.overlap = policy.overlap_comm
        self.use_reduce_scatter = policy.reduce_scatter
        self.keeps_full_grads = policy.keeps_full_gradients
        self.partitions_parameters = policy.partitions_parameters
        self.divisor = 1 if policy.sum_gradients else shard.size * replicate.size
        self.bounded = not (self.keeps_full_grads and shard.size == 1)  # stage 0 reduces in place
        self.unit_ready_callbacks: list[Callable[[FlatUnit], None]] = []
        self.gradient_block = policy.plus_plus.gradient_block if policy.plus_plus.quantized_gradients else None
        self.intra_node, self.inter_node = hierarchy
        if self.gradient_block is not None:
            _check_hierarchy(shard, self.intra_node, self.inter_node)

        self._slot_views: dict[int, torch.Tensor] = {}
        if self.keeps_full_grads:
            for unit in units:
                flat = store.full_gradient(unit)
                for slot in unit.slots:
                    self._slot_views[id(slot)] = flat[slot.offset : slot.offset + slot.numel].view(slot.shape)
        self._written: list[set[int]] = [set() for _ in units]  # stages 0-1, this window
        self._got_gradient: set[int] = set()  # slots whose gradient arrived in this window (any stage)
        for unit in units:
            for slot in unit.slots:
                slot.param.grad = None  # a gradient from before initialize() is not ours

        self._free_buckets: list[tuple[torch.Tensor, Any]] = []  # with the event of a copy still reading it
        self._partitions_as_buckets = self._sums_in_partitions()  # unit index -> its partition (see the top)
        self._bucket_count = 0
        self._bucket_numel = max(unit.padded_numel for unit in units)
        self._hooks = [
            slot.param.register_post_accumulate_grad_hook(self._make_hook(unit, slot))
            for unit in units
            for slot in unit.slots
        ]
        self._reducing = False
        self._window_ends = False
        self._in_backward = False  # inside this engine's backward(), not another loss's
        self._reduced_in_window = False  # stages 0-1: the window's buffer has been reduced
        self._carried: dict[int, torch.Tensor] = {}
        self._local_grads: list[torch.Tensor] | None = None  # stage 2, 1-bit phase: whole local gradients
        # The gradient-synchronisation strategy: reduce while backward runs (default), or
        # accumulate locally and let the caller decide when (no_sync; an optimizer that
        # communicates itself). Local accumulation needs the full buffer (stages 0-1).
        self.sync_in_backward = True
        self.optimizer_exchanges = False  # the optimizer exchanges gradients itself (exchange_for_optimizer)
        self._local_boundary = False
        self._reset_backward_state()

    def _sums_in_partitions(self) -> dict[int, torch.Tensor]:
        """The units whose store partition autograd may sum into directly: a shard group of
        one at stages 2-3, nothing to divide or quantize, and a partition on this device in
        the gradients' own dtype that receiving a reduced chunk would only add into."""
        if (self.keeps_full_grads or self.shard.size != 1 or self.divisor != 1 or self.gradient_block is not None
                or not self.comm_dtype == self.grad_dtype == self.accumulation_dtype):
            return {}
        targets = {unit.index: self.store.summing_target(unit) for unit in self.units}
        return {index: target for index, target in targets.items()
                if target is not None and target.dtype == self.grad_dtype and target.device == self.device
                and target.numel() == self.units[index].padded_numel}

    @property
    def _full_buffers(self) -> bool:
        """Gradients accumulate in whole-unit buffers through `.grad` views: stages 0-1, and
        stage 2 while an optimizer exchanges its own local gradients."""
        return self.keeps_full_grads or (self.optimizer_exchanges and self._local_grads is not None)

    def pooled_buckets(self) -> list[torch.Tensor]:
        """The reduction buckets kept between backward passes (scratch: refilled before use)."""
        return [buffer for buffer, _ in self._free_buckets]

    def zero_grads(self) -> None:
        """Start a new accumulation window (after the optimizer step)."""
        self.store.start_window()
        self._got_gradient = set()
        if not self._full_buffers:
            return
        for unit in self.units:
            for slot in unit.slots:
                slot.param.grad = None
        self._written = [set() for _ in self.units]
        self._reduced_in_window = False

    def _reset_backward_state(self) -> None:
        self._seen: list[set[int]] = [set() for _ in self.units]
        # unit -> (its pooled buffer, or None where the bucket is the unit's partition; the bucket)
        self._buckets: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
        self._ready = [False] * len(self.units)
        self._next_launch = 0
        self._launched: list[_Launched] = []

    # -- backward ----------------------------------------------------------------------
    def begin_backward(self, boundary: bool) -> None:
        """`boundary`: this backward ends an accumulation window. With `sync_in_backward`
        off (the engine's `no_sync`), gradients only accumulate locally: the first
        backward with it on again reduces everything accumulated."""
        synced = self.sync_in_backward and not self.optimizer_exchanges
        self._window_ends = boundary and synced
        self._reducing = synced and (boundary or not self.keeps_full_grads)
        self._local_boundary = boundary and self.sync_in_backward and self.optimizer_exchanges
        self._reset_backward_state()
        if self._reduced_in_window:
            if not self._reducing:
                raise RuntimeError("backward() inside no_sync() after this window's gradients were already "
                                   "reduced: call engine.step() first")
            self._set_reduced_aside()
        self._in_backward = True

    def _set_reduced_aside(self) -> None:
        """Stages 0-1, a second backward() before step() (DeepSpeedExamples' GAN calls it
        once per loss): the full buffers were reduced in place, so they are zeroed to
        receive only the new gradients, and the reduced chunks the store reads from them
        are kept aside and added back once the new ones are reduced. A store with its own
        gradient memory (host tier) keeps its chunks and adds the new ones itself."""
        for unit in self.units:
            full, owned = self.store.full_gradient(unit), self.store.gradient(unit)
            if owned.device == full.device and full.data_ptr() <= owned.data_ptr() < full.data_ptr() + full.nbytes:
                self._carried[unit.index] = owned.clone()
                self.ledger.hold("buffers", tensor_bytes(owned))
            full.zero_()

    def _make_hook(self, unit: FlatUnit, slot: ParamSlot) -> Callable[[torch.Tensor], None]:
        def on_gradient_ready(param: torch.Tensor) -> None:
            self._accept_gradient(unit, slot, param)

        return on_gradient_ready

    def _accept_gradient(self, unit: FlatUnit, slot: ParamSlot, param: torch.Tensor) -> None:
        if not self._in_backward:
            self._accept_foreign_gradient(unit, slot, param)
            return
        seen = self._seen[unit.index]
        if self._reducing and self._next_launch > unit.index:
            raise RuntimeError(
                f"parameter {slot.name} received a gradient after its {unit} was already "
                "reduced in this backward. Call engine.backward() once per micro-batch and use "
                "non-reentrant activation checkpointing (use_reentrant=False)."
            )
        if self._full_buffers:
            view = self._slot_views[id(slot)]
            written = self._written[unit.index]
            if id(slot) not in written:
                view.copy_(param.grad)
                written.add(id(slot))
            elif param.grad is not view:  # a micro-batch's own gradient, or .grad was reset: fold it in
                view.add_(param.grad)
            param.grad = view if self._grads_are_views else None
        else:
            if unit.index not in self._buckets:
                self.prepare_unit(unit)  # later parameters of the unit accumulate in place
            target = self._bucket_for(unit)[slot.offset : slot.offset + slot.numel]
            if param.grad.data_ptr() != target.data_ptr():  # not accumulated in place
                source = param.grad.reshape(-1)
                summed = id(slot) in seen or unit.index in self._partitions_as_buckets
                target.add_(source) if summed else target.copy_(source)
            param.grad = None
        seen.add(id(slot))
        self._got_gradient.add(id(slot))
        if self._reducing and len(seen) == len(unit.slots):
            self._mark_ready(unit)

    def refuse_unused_parameters(self, replicas: Communicator) -> None:
        """Raise `UnusedParametersError` on every rank when a trainable parameter got no
        gradient in this window on any of `replicas` (a MAX all-reduce of one flag per
        parameter, so that ranks agree)."""
        slots = [slot for unit in self.units for slot in unit.slots if slot.param.requires_grad]
        got = torch.tensor([id(slot) in self._got_gradient for slot in slots], dtype=torch.int32)
        replicas.control_all_reduce(got, "which parameters got a gradient in this window", op=dist.ReduceOp.MAX)
        unused = [slot.name for slot, flag in zip(slots, got.tolist()) if not flag]
        if unused:
            raise UnusedParametersError(unused)

    def _accept_foreign_gradient(self, unit: FlatUnit, slot: ParamSlot, param: torch.Tensor) -> None:
        """A gradient from another loss's backward (another engine's, or plain autograd):
        a GAN's generator loss flows through the discriminator's parameters. As in plain
        PyTorch it stays in `.grad`: the script's `zero_grad()` drops it, or this engine's
        next backward adds it in. Only a buffer this window has already reduced cannot
        take it."""
        if (self._full_buffers and self._reduced_in_window
                and (param.grad is self._slot_views[id(slot)] or not self._grads_are_views)):
            raise RuntimeError(
                f"parameter {slot.name} received a gradient from another backward after this engine reduced "
                "its gradients and before its step(): call this engine's step() before back-propagating "
                "another loss through its model"
            )

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
        elif self._local_boundary:  # the optimizer reads this window's local gradients
            for unit in self.units:
                self._fill_missing(unit)
        while self._launched:
            self._complete_oldest()
        self._in_backward = False
        self._reduced_in_window |= self._reducing and self.keeps_full_grads

    def finish_window(self) -> None:
        """End the window at step() rather than in a backward (the caller owns the
        boundary: DeepSpeed's managed_gradient_accumulation false), with the reductions
        the window's last backward would have run. Stages 0-1 accumulated every backward
        locally: each unit's buffer is reduced now, as by a backward that brings nothing
        new. Stages 2-3 reduced every backward into the owned chunks (hop 1): what is left
        is the chunks' sum over the replicate group (hop 2), where there is one."""
        if self.keeps_full_grads:
            self.begin_backward(boundary=True)
            self.end_backward()
            return
        if self.replicate.skips_collectives:
            return
        self._reset_backward_state()
        self._window_ends = True
        try:
            for unit in self.units:
                self._across_replicas(unit, lambda unit=unit: self.store.gradient(unit), f"gradients of {unit}",
                                      lambda: None)
            while self._launched:
                self._complete_oldest()
        finally:
            self._window_ends = False

    def abort_backward(self) -> None:
        """A backward raised part-way (on every rank alike): finish what was launched, so
        no collective is left half-paired, and return the buckets to the pool. The
        caller discards this window's gradients."""
        self._in_backward = False
        try:
            while self._launched:
                self._complete_oldest()
        finally:
            for carried in self._carried.values():
                self.ledger.release("buffers", tensor_bytes(carried))
            self._carried.clear()
            for buffer, _ in self._buckets.values():
                if buffer is not None:
                    self._free_buckets.append((buffer, None))
            for unit in self.units:
                for slot in unit.slots:
                    slot.param.grad = None
            self._reset_backward_state()

    def discard_window(self) -> None:
        """Forget every gradient of the current accumulation window."""
        self.store.zero_gradients()
        self.zero_grads()

    def _fill_missing(self, unit: FlatUnit) -> None:
        if self._full_buffers:
            for slot in unit.slots:
                if id(slot) not in self._written[unit.index]:
                    self._slot_views[id(slot)].zero_()
            return
        if unit.index in self._partitions_as_buckets:
            return  # nothing to add
        bucket = self._bucket_for(unit)
        for slot in unit.slots:
            if id(slot) not in self._seen[unit.index]:
                bucket[slot.offset : slot.offset + slot.numel].zero_()

    def prepare_unit(self, unit: FlatUnit) -> None:
        """Point the `.grad` of the unit's parameters that have none yet at a zeroed
        bucket, so autograd accumulates straight into it: no full-size gradient tensor
        and no copy. Stage 3 calls this just before the unit's backward; stage 2 when the
        unit's first gradient arrives."""
        if self._full_buffers or unit.index in self._buckets:
            return
        bucket = self._bucket_for(unit)
        if self.comm_dtype != self.grad_dtype:
            return  # .grad must have the parameter's dtype
        if unit.index not in self._partitions_as_buckets:  # (a partition holds the window's sum so far)
            bucket[: unit.numel].zero_()
        for slot in unit.slots:
            if slot.param.grad is None and id(slot) not in self._seen[unit.index]:
                slot.param.grad = bucket[slot.offset : slot.offset + slot.numel].view(slot.shape)

    # -- buckets (stages 2-3) ----------------------------------------------------------
    def _bucket_for(self, unit: FlatUnit) -> torch.Tensor:
        """The unit's bucket, taken from the pool on first use in this backward (or its
        partition, which a group of one sums in: `_sums_in_partitions`).

        The pool grows to MAX_IN_FLIGHT + 1 buckets (one filling, the rest in flight);
        beyond that, an empty pool waits for the oldest reduction to return its bucket.
        It grows further only when nothing is in flight (units filling out of order).
        """
        if unit.index in self._buckets:
            return self._buckets[unit.index][1]
        if unit.index in self._partitions_as_buckets:
            self._buckets[unit.index] = (None, self._partitions_as_buckets[unit.index])
            return self._partitions_as_buckets[unit.index]
        if not self._free_buckets and self._launched and self._bucket_count > MAX_IN_FLIGHT:
            self._complete_oldest()
        if self._free_buckets:
            buffer, read = self._free_buckets.pop()
            if read is not None:  # a host copy of its last reduced chunk: the stream waits for it
                read.wait()
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
        while self.bounded and len(self._launched) >= MAX_IN_FLIGHT:
            self._complete_oldest()
        what = f"gradients of {unit}"
        lo, hi = unit.chunk_bounds(self.shard.rank)
        if self.keeps_full_grads:
            grads = self.store.full_gradient(unit)
            if self.comm_dtype == grads.dtype:
                wire = grads
            else:
                wire = grads.to(self.comm_dtype)
                self.ledger.hold("buffers", tensor_bytes(wire))
            wire.div_(self.divisor)
            pending = self._reduce_to_owner(wire, lo, hi, what)

            def copy_back() -> None:
                if wire.data_ptr() != grads.data_ptr():
                    grads[lo:hi].copy_(wire[lo:hi])
                    self.ledger.release("buffers", tensor_bytes(wire))
                self.store.receive_gradient(unit, grads[lo:hi])  # read before any rewrite (see above)
                carried = self._carried.pop(unit.index, None)
                if carried is not None:
                    self.store.gradient(unit).add_(carried)
                    self.ledger.release("buffers", tensor_bytes(carried))

            def finalize() -> None:
                self._across_replicas(unit, lambda: wire[lo:hi], what, copy_back)

        else:
            buffer, bucket = self._buckets.pop(unit.index)
            for slot in unit.slots:  # prepared but never reached by a gradient
                slot.param.grad = None
            pending = self._reduce_to_owner(bucket, lo, hi, what, divide_by=self.divisor)

            def finalize() -> None:
                read = self.store.receive_gradient(unit, bucket[lo:hi])  # (nothing to add: a partition)
                if buffer is not None:
                    self._free_buckets.append((buffer, read))
                self._across_replicas(unit, lambda: self.store.gradient(unit), what, lambda: None)

        self._enqueue(_Launched(unit, pending, finalize))

    def _enqueue(self, launched: _Launched) -> None:
        """Track an in-flight reduction; one that finished at once (a group of one rank)
        goes straight on to its next hop."""
        if launched.pending.work is None:
            launched.finalize()
            return
        self._launched.append(launched)
        if not self.overlap:
            self._complete_oldest()

    def _reduce_to_owner(self, full: torch.Tensor, lo: int, hi: int, what: str, *,
                         divide_by: float = 1.0) -> PendingCollective:
        """Sum `full` / `divide_by` over the shard group so that this rank's [lo, hi) holds
        the result; only that chunk may be read afterwards (the shared-memory transport
        divides as it copies and leaves the rest of `full` undivided)."""
        if self.gradient_block is None and self.use_reduce_scatter:
            return self.shard.reduce_scatter(full[lo:hi], full, what, divide_by=divide_by)
        if divide_by != 1.0:
            full.div_(divide_by)
        if self.gradient_block is not None:
            return HierarchicalQuantizedReduceScatter(full[lo:hi], full, intra=self.intra_node, inter=self.inter_node,
                                                      block=self.gradient_block, what=what, ledger=self.ledger)
        return self.shard.all_reduce(full, what)

    def _across_replicas(self, unit: FlatUnit, owned: Callable[[], torch.Tensor], what: str,
                         then: Callable[[], None]) -> None:
        """Second hop: at the end of a window, sum the owned chunk (asked of `owned` only
        then: a host tier waits for its copy) over the replicate group; `then` runs once
        the chunk is final. A host tier's chunk crosses an NCCL group as a device copy."""
        if self.replicate.skips_collectives or not self._window_ends:
            then()
            return
        chunk = owned()
        device = self.replicate.staging_device
        if device is None or chunk.device == device:
            self._enqueue(_Launched(unit, self.replicate.all_reduce(chunk, what), then))
            return
        staged = chunk.to(device)  # a host tier's sum over an NCCL group (distributed/staging.py)
        self.ledger.hold("buffers", tensor_bytes(staged))

        def copy_back() -> None:
            chunk.copy_(staged)
            self.ledger.release("buffers", tensor_bytes(staged))
            then()

        self._enqueue(_Launched(unit, self.replicate.all_reduce(staged, what), copy_back))

    def _complete_oldest(self) -> None:
        launched = self._launched.pop(0)
        launched.pending.wait()
        launched.finalize()

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()


def _check_hierarchy(shard: Communicator, intra: Communicator | None, inter: Communicator | None) -> None:
    """qgZ's two hops must tile the shard group as chunk ownership expects: the member at
    place l of node k is shard rank k·L + l (distributed/mesh.py builds them so)."""
    if intra is None or inter is None:
        raise ValueError("quantized gradients need the shard group cut by node (the mesh's shard_node and "
                         "shard_nodes groups): build the mesh with shard_by_node")
    if shard.handle.ranks[inter.rank * intra.size + intra.rank] != shard.global_rank or (
            intra.size * inter.size != shard.size):
        raise ValueError(f"the shard group {list(shard.handle.ranks)} is not node-major over the groups "
                         f"{list(intra.handle.ranks)} (inside the node) and {list(inter.handle.ranks)} (across "
                         "nodes): qgZ's chunk order would not match the reduce-scatter's")
