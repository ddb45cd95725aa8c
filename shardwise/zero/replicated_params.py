"""Parameters in stages 0-2: every rank holds all of them, in one flat buffer.

Each parameter becomes a view into the flat buffer of its unit, so after the optimizer
has updated this rank's chunk, one all-gather per unit (issued in pieces of at most
`allgather_bucket_size` elements) writes every rank's updated chunk straight into the
parameters: no copies, no temporary buffers (C2).
"""

from __future__ import annotations

import torch

from shardwise.accounting import MemoryLedger, tensor_bytes
from shardwise.distributed.collectives import Communicator, PendingCollective
from shardwise.zero.layout import FlatUnit


class ReplicatedParameters:
    def __init__(
        self,
        units: list[FlatUnit],
        dtype: torch.dtype,
        device: torch.device,
        comm: Communicator,
        ledger: MemoryLedger,
        chunk: int,
        allgather_bucket_size: int,
    ):
        self.units = units
        self.comm = comm
        self.chunk = chunk
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
        lo, hi = unit.chunk_bounds(self.chunk)
        return self.unit_flats[unit.index][lo:hi]

    def broadcast_from_rank0(self) -> None:
        """Start every rank from rank 0's weights, as DDP does."""
        self.comm.broadcast(self.flat, 0, "initial parameters")

    def after_step(self) -> None:
        """All-gather every unit's updated chunks into the full parameters (stages 1-3;
        stage 0 updated the full parameters already)."""
        if self.chunk == 0 and self.units and self.units[0].num_chunks == 1:
            return
        pending: list[PendingCollective] = []
        world = self.comm.world_size
        for unit in self.units:
            flat = self.unit_flats[unit.index]
            what = f"parameters of {unit}"
            piece = max(1, self.allgather_bucket_size // world)
            if unit.chunk_numel <= piece:
                lo, hi = unit.chunk_bounds(self.comm.rank)
                pending.append(self.comm.all_gather(flat, flat[lo:hi], what))
                continue
            for start in range(0, unit.chunk_numel, piece):
                stop = min(start + piece, unit.chunk_numel)
                views = [
                    flat[r * unit.chunk_numel + start : r * unit.chunk_numel + stop]
                    for r in range(world)
                ]
                pending.append(self.comm.all_gather_pieces(views, views[self.comm.rank], what))
        for handle in pending:
            handle.wait()
