"""Every collective the engine issues goes through `Communicator`, for three reasons.

1. Accounting (SPEC §4, C6): each call adds the bytes this rank sends in a
   bandwidth-optimal ring, so `engine.comm_volume()` is measured, not estimated:
   all-reduce of S bytes = 2S(N-1)/N, all-gather / reduce-scatter of a full S = S(N-1)/N.
2. Errors that say what went wrong: a failed or timed-out collective raises
   `CollectiveError` naming the rank, the operation and what was being moved
   ("reduce_scatter of bucket 3 (layers.2.mlp)"), instead of a bare gloo message.
3. Overlap: every data collective is asynchronous and returns a `PendingCollective`;
   the caller decides when to wait. With NCCL the work runs on the process group's own
   communication stream and `wait()` only orders the current stream after it; with gloo
   it runs on gloo's threads while the Python thread keeps computing.

Small synchronisation collectives (gradient norm, overflow flag, gather-order checks) run
on a second, CPU-side gloo group and are counted under "control", apart from the data
volume the ZeRO formulas describe. Their own group means a check never queues behind a
large in-flight gather, and on GPUs it needs no device synchronisation of its own.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from shardwise.accounting import MemoryLedger
from shardwise.distributed import point_to_point
from shardwise.distributed.setup import DistributedContext


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message names rank, operation and payload."""


def ring_bytes(op: str, full_bytes: int, world_size: int) -> int:
    """Bytes one rank sends for `op` over a full tensor of `full_bytes`, ring algorithm."""
    if world_size == 1:
        return 0
    share = full_bytes * (world_size - 1) // world_size
    return 2 * share if op == "all_reduce" else share


@dataclass
class PendingCollective:
    """Handle to an in-flight collective; `wait()` re-raises failures with context."""

    work: dist.Work | point_to_point.PointToPointWork | None
    op: str
    what: str
    communicator: "Communicator"
    started: float = field(default_factory=time.monotonic)

    def wait(self) -> None:
        if self.work is None:
            return
        work, self.work = self.work, None
        blocked_from = time.perf_counter()
        try:
            work.wait()
        except Exception as error:  # gloo/NCCL raise RuntimeError subclasses
            waited = time.monotonic() - self.started
            raise CollectiveError(
                f"rank {self.communicator.rank}: {self.op} of {self.what} failed after "
                f"{waited:.1f}s: {error}. "
                "If ranks run different modules or a different number of steps "
                "(data-dependent branches, uneven data), their collectives no longer pair up."
            ) from error
        finally:
            self.communicator.wait_seconds += time.perf_counter() - blocked_from


class Communicator:
    """Counted, error-naming collectives over one data-parallel process group."""

    def __init__(self, context: DistributedContext, ledger: MemoryLedger | None = None):
        """`ledger` receives the receive buffers of gloo reduce-scatters as "buffers"."""
        self.context = context
        self.ledger = ledger if ledger is not None else MemoryLedger()
        self.rank = context.rank
        self.world_size = context.world_size
        self.group = context.group
        self.control_group = (
            dist.new_group(backend="gloo", timeout=context.timeout) if self.world_size > 1 else None
        )
        # gloo's own reduce-scatter / all-gather copy and all-reduce the whole input
        self.point_to_point = self.world_size > 1 and dist.get_backend(self.group) == "gloo"
        self._sequence = 0  # tags point-to-point collectives; advances alike on every rank
        self.volume: Counter[str] = Counter()
        self.wait_seconds = 0.0  # time the training thread spent blocked on collectives

    # -- accounting ---------------------------------------------------------------
    def _count(self, op: str, full: torch.Tensor) -> None:
        self.volume[op] += ring_bytes(op, full.numel() * full.element_size(), self.world_size)

    def comm_volume(self) -> dict[str, int]:
        keys = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "control")
        return {key: int(self.volume.get(key, 0)) for key in keys}

    def reset_comm_volume(self) -> None:
        self.volume.clear()

    # -- data collectives -----------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, what: str) -> PendingCollective:
        """Sum `tensor` in place over all ranks."""
        if self.world_size == 1:
            return PendingCollective(None, "all_reduce", what, self)
        self._count("all_reduce", tensor)
        work = dist.all_reduce(tensor, group=self.group, async_op=True)
        return PendingCollective(work, "all_reduce", what, self)

    def reduce_scatter(
        self, output: torch.Tensor, full: torch.Tensor, what: str
    ) -> PendingCollective:
        """Sum `full` over ranks; this rank receives chunk `rank` into `output`.

        `output` may alias `full`'s own chunk (in place), which saves a buffer.
        """
        if self.world_size == 1:
            if output.data_ptr() != full.data_ptr():
                output.copy_(full)
            return PendingCollective(None, "reduce_scatter", what, self)
        self._count("reduce_scatter", full)
        if self.point_to_point:
            receive_bytes = full.numel() * full.element_size() * (self.world_size - 1) // self.world_size
            self.ledger.hold("buffers", receive_bytes)
            work = point_to_point.reduce_scatter(
                output, full, self.group, self.rank, self.world_size, self._next_tag(),
                on_free=lambda nbytes: self.ledger.release("buffers", nbytes),
            )
        else:
            work = dist.reduce_scatter_single(output, full, group=self.group, async_op=True)
        return PendingCollective(work, "reduce_scatter", what, self)

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor, what: str) -> PendingCollective:
        """Concatenate every rank's `shard` into `full` (`shard` may be `full`'s own chunk)."""
        if self.world_size == 1:
            if shard.data_ptr() != full.data_ptr():
                full.copy_(shard)
            return PendingCollective(None, "all_gather", what, self)
        if self.point_to_point:
            return self.all_gather_pieces(list(full.chunk(self.world_size)), shard, what)
        self._count("all_gather", full)
        work = dist.all_gather_single(full, shard, group=self.group, async_op=True)
        return PendingCollective(work, "all_gather", what, self)

    def all_gather_pieces(
        self, pieces: list[torch.Tensor], shard: torch.Tensor, what: str
    ) -> PendingCollective:
        """All-gather into `pieces[r]` (views anywhere) from each rank's `shard`."""
        if self.world_size == 1:
            if shard.data_ptr() != pieces[0].data_ptr():
                pieces[0].copy_(shard)
            return PendingCollective(None, "all_gather", what, self)
        self.volume["all_gather"] += ring_bytes(
            "all_gather", sum(p.numel() * p.element_size() for p in pieces), self.world_size
        )
        if self.point_to_point:
            work = point_to_point.all_gather(
                pieces, shard, self.group, self.rank, self.world_size, self._next_tag()
            )
        else:
            work = dist.all_gather(pieces, shard, group=self.group, async_op=True)
        return PendingCollective(work, "all_gather", what, self)

    def _next_tag(self) -> int:
        self._sequence = (self._sequence + 1) % (2**31 - 1)
        return self._sequence

    def broadcast(self, tensor: torch.Tensor, source: int, what: str) -> None:
        if self.world_size == 1:
            return
        self._count("broadcast", tensor)
        work = dist.broadcast(tensor, src=source, group=self.group, async_op=True)
        PendingCollective(work, "broadcast", what, self).wait()

    # -- control collectives ----------------------------------------------------------
    def control_all_reduce(
        self, tensor: torch.Tensor, what: str, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
    ) -> torch.Tensor:
        """Blocking all-reduce of a small tensor (in place), counted under "control"."""
        if self.world_size == 1:
            return tensor
        self.volume["control"] += ring_bytes(
            "all_reduce", tensor.numel() * tensor.element_size(), self.world_size
        )
        on_cpu = tensor.cpu()
        work = dist.all_reduce(on_cpu, op=op, group=self.control_group, async_op=True)
        PendingCollective(work, "all_reduce", what, self).wait()
        if on_cpu is not tensor:
            tensor.copy_(on_cpu)
        return tensor

    def control_all_gather_object(self, value: object) -> list[object]:
        """Every rank's `value` (pickled): for error reports, never on the hot path."""
        if self.world_size == 1:
            return [value]
        gathered: list[object] = [None] * self.world_size
        dist.all_gather_object(gathered, value, group=self.control_group)
        return gathered

    def barrier(self, what: str) -> None:
        if self.world_size > 1:
            self.control_all_reduce(torch.zeros(1, device=self.context.device), what)
