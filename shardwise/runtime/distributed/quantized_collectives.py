"""Collectives that carry block-quantized payloads (C28: ZeRO++'s qwZ and qgZ).

Each is started like a `Communicator` collective and returns an object with the same
`work` / `wait()` interface as `PendingCollective`, so the ZeRO code that overlaps
collectives with compute waits on them the same way. The bytes are counted by the
communicators they run on, as the frames they send (quantized.py).

`QuantizedAllGather` (qwZ): every rank quantizes its shard to int8, the frames are
all-gathered, and `wait()` dequantizes all of them, the rank's own included, into the
full buffer, so every rank computes with the same values.

`HierarchicalQuantizedReduceScatter` (qgZ) replaces a reduce-scatter over a shard group of
n nodes × L ranks by two all-to-alls carrying int4:

1. inside the node (`intra`, L ranks): rank l of a node sends local rank j the n chunks
   whose owners sit at place j of their node (chunks j, L + j, 2L + j, ...); j dequantizes
   what its L node-mates sent and sums it in fp32: the node's partial sums of those n chunks;
2. across nodes (`inter`, the n ranks at place j of every node): node k's partial of chunk
   k·L + j goes to node k, which sums the n partials in fp32: its chunk of the full sum.

The ring reduce-scatter it replaces accumulates each chunk through N − 1 hops, and a
quantized ring would round it again at every hop; here every contribution is rounded
twice, whatever N (Wang et al., 2023, §4.3). Chunk c of the full tensor belongs to shard
rank c = k·L + l, the member at place l of node k, as the mesh builds the groups.
"""

from __future__ import annotations

import torch

from shardwise.runtime.accounting import MemoryLedger, tensor_bytes
from shardwise.runtime.distributed.collectives import Communicator, PendingCollective
from shardwise.runtime.distributed.quantized import dequantize, quantize, sum_rows

WEIGHT_BITS = 8  # qwZ: int8 weights
GRADIENT_BITS = 4  # qgZ: int4 gradients


class QuantizedAllGather:
    """All-gather `shard` from every rank of `comm` into `full` (chunk r from rank r) as
    int8 frames; `full` holds the dequantized values after `wait()`."""

    def __init__(self, comm: Communicator, full: torch.Tensor, shard: torch.Tensor, *, block: int, what: str,
                 ledger: MemoryLedger):
        self.full = full
        self.chunk_numel = shard.numel()
        self.block = block
        self.ledger = ledger
        frame = quantize(shard.reshape(1, -1), block=block, bits=WEIGHT_BITS)
        self.frames = torch.empty(comm.size, frame.shape[1], dtype=torch.uint8, device=full.device)
        self.frames[comm.rank].copy_(frame[0])
        ledger.hold("buffers", tensor_bytes(self.frames))
        self.pending = comm.all_gather(self.frames.view(-1), self.frames[comm.rank],
                                       f"{what} (int8, qwZ)")

    @property
    def work(self) -> object:
        """Not None until `wait()` has run: the dequantization is part of the collective."""
        return self.pending

    def wait(self) -> None:
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        pending.wait()
        values = dequantize(self.frames, numel=self.chunk_numel, block=self.block, bits=WEIGHT_BITS)
        self.full.copy_(values.reshape(-1))
        self.ledger.release("buffers", tensor_bytes(self.frames))
        self.frames = None


class HierarchicalQuantizedReduceScatter:
    """Sum `full` over the shard group made of `intra` (this node's members) x `inter`
    (one member per node); this rank's chunk of the sum lands in `output` (which may
    alias that chunk of `full`) after `wait()`."""

    def __init__(self, output: torch.Tensor, full: torch.Tensor, *, intra: Communicator, inter: Communicator,
                 block: int, what: str, ledger: MemoryLedger):
        nodes, local = inter.size, intra.size
        self.chunk_numel = full.numel() // (nodes * local)
        if self.chunk_numel * nodes * local != full.numel() or output.numel() != self.chunk_numel:
            raise ValueError(f"{what}: {full.numel()} elements do not split into {nodes} x {local} chunks of "
                             f"{output.numel()}")
        self.output, self.inter, self.block, self.what, self.ledger = output, inter, block, what, ledger
        # row j: the chunks owned by place j of every node, node by node
        rows = full.view(nodes, local, self.chunk_numel).transpose(0, 1).reshape(local, nodes * self.chunk_numel)
        self.sent = quantize(rows, block=block, bits=GRADIENT_BITS)
        self.received = torch.empty_like(self.sent)
        self.held = 2 * tensor_bytes(self.sent)
        ledger.hold("buffers", self.held)
        self.pending: PendingCollective | None = intra.all_to_all(
            self.received.view(-1), self.sent.view(-1), f"{what} (int4, qgZ inside the node)")

    @property
    def work(self) -> object:
        """Not None until `wait()` has run: the dequantization is part of the collective."""
        return self.pending

    def wait(self) -> None:
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        pending.wait()
        nodes = self.inter.size
        partial = sum_rows(dequantize(self.received, numel=nodes * self.chunk_numel, block=self.block,
                                      bits=GRADIENT_BITS))
        sent = quantize(partial.view(nodes, self.chunk_numel), block=self.block, bits=GRADIENT_BITS)
        received = torch.empty_like(sent)
        self.inter.all_to_all(received.view(-1), sent.view(-1), f"{self.what} (int4, qgZ across nodes)").wait()
        total = sum_rows(dequantize(received, numel=self.chunk_numel, block=self.block, bits=GRADIENT_BITS))
        self.output.copy_(total)
        self.ledger.release("buffers", self.held)
        self.sent = self.received = None
