"""Parameters in stages 0-2: every rank holds all of them, in one flat buffer.

Each parameter becomes a view into the flat buffer of its unit, so after the optimizer
has updated this rank's chunk, one all-gather per unit over the shard group (issued in
pieces of at most `allgather_bucket_size` elements) writes every rank's updated chunk
straight into the parameters: no copies, no temporary buffers (C2). With a shard group
of one rank (stage 0) there is nothing to gather.
"""

from __future__ import annotations

import torch

from shardwise.runtime.accounting import MemoryLedger, tensor_bytes
from shardwise.runtime.distributed.collectives import Communicator, PendingCollective
from shardwise.runtime.zero.layout import FlatUnit
from shardwise.runtime.zero.strategy import ParameterStrategy


class ReplicatedParameters(ParameterStrategy):
    def __init__(
        self,
        units: list[FlatUnit],
        dtype: torch.dtype,
        device: torch.device,
        shard: Communicator,
        replicas: Communicator,
        ledger: MemoryLedger,
        allgather_bucket_size: int,
    ):
        """`shard`: the group the units are split over; `replicas`: every rank holding
        the same parameters (initial weights and edits are broadcast over it)."""
        self.units = units
        self.shard = shard
        self.replicas = replicas
        self.allgather_bucket_size = allgather_bucket_size
        sizes = [unit.padded_numel for unit in units]
        self.flat = torch.zeros(sum(sizes), dtype=dtype, device=device)
        ledger.hold("params", tensor_bytes(self.flat))
        self.unit_flats = dict(zip((unit.index for unit in units), torch.split(self.flat, sizes)))
        with torch.no_grad():
            for unit in units:
                flat = self.unit_flats[unit.index]
                for slot in unit.slots:
                    view = flat[slot.offset : slot.offset + slot.numel].view(slot.shape)
                    view.copy_(slot.param.detach())
                    slot.param.data = view

    def owned_chunk(self, unit: FlatUnit) -> torch.Tensor:
        """This rank's chunk of `unit` (the whole unit when states are not partitioned)."""
        lo, hi = unit.chunk_bounds(self.shard.rank)
        return self.unit_flats[unit.index][lo:hi]

    def broadcast_initial(self) -> None:
        """Start every replica from the first one's weights, as DDP does."""
        self.replicas.broadcast(self.flat, 0, "initial parameters")

    def after_update(self) -> None:
        """All-gather every unit's updated chunks into the full parameters."""
        if self.shard.skips_collectives:
            return
        pending: list[PendingCollective] = []
        world = self.shard.size
        piece = max(1, self.allgather_bucket_size // world)
        for unit in self.units:
            flat = self.unit_flats[unit.index]
            what = f"parameters of {unit}"
            if unit.chunk_numel <= piece:
                lo, hi = unit.chunk_bounds(self.shard.rank)
                pending.append(self.shard.all_gather(flat, flat[lo:hi], what))
                continue
            for start in range(0, unit.chunk_numel, piece):
                stop = min(start + piece, unit.chunk_numel)
                views = [
                    flat[r * unit.chunk_numel + start : r * unit.chunk_numel + stop]
                    for r in range(world)
                ]
                pending.append(self.shard.all_gather_pieces(views, views[self.shard.rank], what))
        for handle in pending:
            handle.wait()

    # -- gathered_parameters: values are always whole here --------------------------------
    def acquire(self, units: list[FlatUnit]) -> None:
        return

    def release(self, units: list[FlatUnit]) -> None:
        return

    def broadcast_edits(self, unit: FlatUnit, source: int) -> None:
        self.replicas.broadcast(self.unit_flats[unit.index], source, f"edited parameters of {unit}")
