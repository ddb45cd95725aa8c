"""Parameters in stage 3: each rank stores 1/N of every unit and gathers on use (C4).

A unit's parameters are gathered into a fresh flat buffer by one all-gather, and each
parameter's `.data` is pointed at its slice; releasing points `.data` at an empty tensor
so the buffer is freed. Touching a released parameter therefore fails loudly (a shape
error) instead of reading stale memory. Autograd saves parameters by reference, so a
parameter gathered again before its module's backward is what backward reads.

Gathers are asynchronous: `fetch` starts one, `wait` finishes it. A reference count per
unit lets nested users (a module and `gathered_parameters`) share one gather.
"""

from __future__ import annotations

import torch

from shardwise.accounting import MemoryLedger, tensor_bytes
from shardwise.distributed.collectives import Communicator, PendingCollective
from shardwise.zero.layout import FlatUnit


class ShardedParameters:
    def __init__(
        self,
        units: list[FlatUnit],
        dtype: torch.dtype,
        device: torch.device,
        comm: Communicator,
        ledger: MemoryLedger,
    ):
        self.units = units
        self.dtype = dtype
        self.device = device
        self.comm = comm
        self.ledger = ledger
        sizes = [unit.chunk_numel for unit in units]
        self.shard_flat = torch.zeros(sum(sizes), dtype=dtype, device=device)
        ledger.hold("params", tensor_bytes(self.shard_flat))
        self.shards = dict(zip((u.index for u in units), torch.split(self.shard_flat, sizes)))
        self.gathered: dict[int, torch.Tensor] = {}
        self.pending: dict[int, PendingCollective] = {}
        self.users: dict[int, int] = {}
        self.empty = torch.empty(0, dtype=dtype, device=device)

    # -- building the shards -------------------------------------------------------------
    def take_shard_from_full(self, unit: FlatUnit) -> None:
        """Copy this rank's chunk out of the parameters' current full values, then release.

        Used once at start-up (every rank holds the same full weights: the model was
        broadcast or initialised identically) and by `gathered_parameters` after edits.
        """
        shard = self.shards[unit.index]
        with torch.no_grad():
            for piece in unit.owned_pieces(self.comm.rank):
                source = piece.slot.param.detach().reshape(-1)[piece.start : piece.stop]
                shard[piece.chunk_offset : piece.chunk_offset + piece.numel].copy_(source)
        if unit.index not in self.gathered:
            for slot in unit.slots:
                slot.param.data = self.empty

    def owned_chunk(self, unit: FlatUnit) -> torch.Tensor:
        return self.shards[unit.index]

    # -- gather / release ----------------------------------------------------------------
    def is_available(self, unit: FlatUnit) -> bool:
        """Gathered or being gathered."""
        return unit.index in self.gathered or unit.index in self.pending

    def fetch(self, unit: FlatUnit) -> None:
        """Start gathering `unit` unless it is already gathered or in flight."""
        if self.is_available(unit):
            return
        buffer = torch.empty(unit.padded_numel, dtype=self.dtype, device=self.device)
        self.ledger.hold("buffers", tensor_bytes(buffer))
        self.gathered[unit.index] = buffer
        self.pending[unit.index] = self.comm.all_gather(
            buffer, self.shards[unit.index], f"parameters of {unit}"
        )

    def wait(self, unit: FlatUnit) -> None:
        """Finish the gather of `unit` and point its parameters at the result."""
        pending = self.pending.pop(unit.index, None)
        if pending is None:
            return
        pending.wait()
        buffer = self.gathered[unit.index]
        for slot in unit.slots:
            slot.param.data = buffer[slot.offset : slot.offset + slot.numel].view(slot.shape)

    def acquire(self, unit: FlatUnit) -> None:
        self.fetch(unit)
        self.wait(unit)
        self.users[unit.index] = self.users.get(unit.index, 0) + 1

    def release_use(self, unit: FlatUnit) -> int:
        """Drop one user; returns how many remain."""
        remaining = self.users.get(unit.index, 0) - 1
        if remaining <= 0:
            self.users.pop(unit.index, None)
            return 0
        self.users[unit.index] = remaining
        return remaining

    def free(self, unit: FlatUnit) -> None:
        """Drop the gathered copy (waiting first if it is still in flight)."""
        if unit.index not in self.gathered:
            return
        self.wait(unit)
        buffer = self.gathered.pop(unit.index)
        self.users.pop(unit.index, None)
        for slot in unit.slots:
            slot.param.data = self.empty
        self.ledger.release("buffers", tensor_bytes(buffer))

    def gathered_numel(self) -> int:
        return sum(buffer.numel() for buffer in self.gathered.values())
