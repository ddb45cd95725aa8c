"""Reduced gradient chunks on their way from the device to the host partition (C11).

Why: the reducer hands each reduced chunk to the store inside backward (an autograd hook).
Copying it there with `chunk.to("cpu")` allocates fresh pageable memory and blocks until
the copy is done, so backward waits on every transfer: no overlap is left. Here a chunk is
copied, without blocking, into a staging buffer on a side stream that first waits for the
current stream (where the reduction's result is final), and an event is recorded after
the copy. The staging buffers are allocated once (at most `STAGING_BUFFERS` per dtype,
each the size of the largest unit chunk: what one reduced bucket hands over) and reused;
they are page-locked when CUDA is available and `offload_optimizer.pin_memory` is set,
which is what makes the copy asynchronous. The chunk is added into the fp32 host partition
(on the CPU) only when a reader needs it: the optimizer's step of a sub-group settles the
copies of exactly that sub-group's units, each after its own event, and the gradient norm
settles unit by unit; nothing waits for the whole device. A buffer is also settled early
when all are in use, or once its copy is seen finished.

The caller must not write the chunk's memory again before the copy is done: `receive`
returns the copy's event, and the reducer makes the current stream wait on it before it
reuses that memory (gradients.py), a wait on the device, not on the host.

Without CUDA the chunk already is host memory: it is added straight into the partition,
with no copy and no allocation (the partition is the reused buffer).
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Callable

import torch

from shardwise.runtime.accounting import MemoryLedger, tensor_bytes

STAGING_BUFFERS = 4  # per dtype: copies that may be in flight before the oldest is settled


class SideStream:
    """Device -> host copies on a stream of their own, each followed by a recorded event.
    Built from torch.cuda's pieces (`on`); the tests pass stand-ins where CUDA is absent."""

    def __init__(self, stream: Any, current: Callable[[], Any], use: Callable[[Any], AbstractContextManager],
                 new_event: Callable[[], Any]):
        self.stream = stream
        self.current = current
        self.use = use
        self.new_event = new_event

    @classmethod
    def on(cls, device: torch.device) -> "SideStream":
        return cls(torch.cuda.Stream(device), lambda: torch.cuda.current_stream(device), torch.cuda.stream,
                   torch.cuda.Event)

    def copy(self, target: torch.Tensor, source: torch.Tensor) -> Any:
        """Start copying `source` into `target`; returns the event that marks its end."""
        self.stream.wait_stream(self.current())
        with self.use(self.stream):
            target.copy_(source, non_blocking=True)
            event = self.new_event()
            event.record(self.stream)
        return event


def side_stream_for(device: torch.device) -> SideStream | None:
    """The copy stream for gradients reduced on `device`; None when they are host memory."""
    return SideStream.on(device) if device.type == "cuda" else None


@dataclass
class _Copy:
    unit: int
    buffer: torch.Tensor  # the whole staging buffer, back to the pool once added in
    staged: torch.Tensor  # the part the chunk was copied into
    target: torch.Tensor  # the unit's fp32 host gradient
    done: Any  # the copy's event


class GradientCopies:
    def __init__(self, *, chunk_numel: int, pin: bool, ledger: MemoryLedger, stream: SideStream | None):
        """`chunk_numel`: the largest chunk one copy carries; `pin`: page-locked buffers."""
        self.chunk_numel = chunk_numel
        self.pin = pin
        self.ledger = ledger
        self.stream = stream
        self.free: dict[torch.dtype, list[torch.Tensor]] = {}
        self.allocated: dict[torch.dtype, int] = {}
        self.pending: list[_Copy] = []  # copies not yet added in, oldest first

    def receive(self, unit: int, reduced: torch.Tensor, target: torch.Tensor) -> Any:
        """Add `reduced` (unit `unit`'s chunk) into `target`, now or once its copy is done;
        returns the event after which `reduced`'s memory may be written again (None: at once)."""
        if self.stream is None:
            target.add_(reduced)
            return None
        finished = 0
        while finished < len(self.pending) and self.pending[finished].done.query():
            finished += 1
        self._settle(self.pending[:finished])  # in order: a unit's chunks add up as they came
        buffer = self._buffer(reduced.dtype)
        staged = buffer[: reduced.numel()].view(reduced.shape)
        done = self.stream.copy(staged, reduced)
        self.pending.append(_Copy(unit, buffer, staged, target, done))
        return done

    def settle(self, units: Iterable[int] | None = None) -> None:
        """Add the pending copies of `units` (every unit: None) into their targets, each
        once its own event has passed."""
        wanted = None if units is None else set(units)
        self._settle([copy for copy in self.pending if wanted is None or copy.unit in wanted])

    def discard(self) -> None:
        """Drop every pending copy (the partition is being zeroed): each buffer goes back to
        the pool once its copy is done, nothing is added."""
        pending, self.pending = self.pending, []
        for copy in pending:
            copy.done.synchronize()
            self.free[copy.buffer.dtype].append(copy.buffer)

    def _settle(self, copies: list[_Copy]) -> None:
        for copy in copies:  # oldest first: a unit's chunks add up in the order they came
            copy.done.synchronize()
            copy.target.add_(copy.staged)
            self.free[copy.buffer.dtype].append(copy.buffer)
        settled = {id(copy) for copy in copies}
        self.pending = [copy for copy in self.pending if id(copy) not in settled]

    def _buffer(self, dtype: torch.dtype) -> torch.Tensor:
        """A free staging buffer of `dtype`: from the pool, newly allocated while fewer than
        STAGING_BUFFERS exist, else the oldest copy of that dtype is settled first."""
        free = self.free.setdefault(dtype, [])
        if not free and self.allocated.get(dtype, 0) < STAGING_BUFFERS:
            buffer = torch.empty(self.chunk_numel, dtype=dtype, pin_memory=self.pin)
            self.ledger.hold("buffers", tensor_bytes(buffer), tier="host")
            self.allocated[dtype] = self.allocated.get(dtype, 0) + 1
            return buffer
        while not free:
            self._settle(self.pending[:1])
        return free.pop()
