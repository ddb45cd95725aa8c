"""Every collective the engine issues goes through a `Communicator`, one per group, for
three reasons.

1. Accounting (docs/formulas.md#the-ring-model, C6): each call adds the bytes this rank sends in a
   bandwidth-optimal ring, per (group, operation), so `engine.comm_volume()` is measured,
   not estimated: all-reduce of S bytes = 2S(N-1)/N, all-gather / reduce-scatter /
   all-to-all of a full S = S(N-1)/N, with N the size of the group it runs in. When the
   job spans nodes the same bytes are also counted per link (docs/formulas.md#bytes-between-nodes):
   a ring's rank sends everything to its successor, so its bytes cross between nodes when
   the successor is on another node; an all-to-all's chunk to each peer crosses when that
   peer is.
2. Errors that say what went wrong: a failed or timed-out collective raises
   `CollectiveError` naming the rank, the operation, what was being moved and the group
   ("rank 0: reduce_scatter of gradients of unit 3 (layers.2.mlp) in the shard group
   (ranks 0-1)"), and, when a connection was lost, which peer is gone.
3. Overlap: every data collective is asynchronous and returns a `PendingCollective`;
   the caller decides when to wait. With NCCL the work runs on the process group's own
   communication stream and `wait()` only orders the current stream after it; with gloo
   it runs on gloo's threads while the Python thread keeps computing. When every member
   of a gloo group is on this host, CPU reduce-scatters, all-gathers and all-reduces go
   through a shared segment instead, run by a worker thread of the group's (shared_memory.py).

A communicator takes its rank and size from its group: rank r of a group is the r-th of
its members, and that index is the chunk a rank owns, what `broadcast` sources name,
and what errors report beside the global rank.

Small synchronisation collectives (gradient norm, overflow flag, gather-order checks) run
on the group's CPU-side gloo *control* group and are counted under "control", apart from
the data volume the ZeRO formulas describe. Their own group means a check never queues
behind a large in-flight gather, and on GPUs it needs no device synchronisation of its own.
"""

from __future__ import annotations

import datetime
import os
import pickle
import time
import zlib
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from shardwise.runtime.accounting import MemoryLedger
from shardwise.runtime.distributed import point_to_point, shared_memory
from shardwise.runtime.distributed.blocked_waits import AbandonedWait, wait_watching, watched_check
from shardwise.runtime.distributed.flight_recorder import RECORDER, CollectiveRecord
from shardwise.runtime.distributed.mesh import GroupHandle, ParallelMesh
from shardwise.runtime.distributed.peers import PeerDirectory
from shardwise.runtime.distributed.retired_works import retire
from shardwise.runtime.distributed.setup import collective_timeout
from shardwise.runtime.base.torch_compat import all_gather_single, reduce_scatter_single

# Test-only (see `Communicator`): "1" makes groups of one issue their data collectives.
COLLECTIVES_AT_SIZE_ONE_VARIABLE = "SHARDWISE_COLLECTIVES_AT_WORLD_SIZE_1"


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message names rank, operation, payload and group."""


class MismatchedCallError(CollectiveError):
    """Ranks entered different collective operations (e.g. one called save_checkpoint)."""


def ring_bytes(op: str, full_bytes: int, world_size: int) -> int:
    """Bytes one rank sends for `op` over a full tensor of `full_bytes`, ring algorithm."""
    if world_size == 1:
        return 0
    share = full_bytes * (world_size - 1) // world_size
    return 2 * share if op == "all_reduce" else share


@dataclass
class CommStats:
    """Shared by all communicators of an engine: bytes per (group, operation) and the
    seconds the training thread spent blocked waiting on collectives.

    On an NCCL group `wait()` returns at once, having only ordered the current stream
    after the collective, so host time says nothing there: while a step timer asks
    (`device_waits` a list, not None) each wait of such a communicator (its control
    collectives' too: the device idles while the host blocks in them) is bracketed by
    CUDA events on the current stream, read when the timer reports
    (profiling/step_timer.py)."""

    volume: Counter = field(default_factory=Counter)
    links: Counter = field(default_factory=Counter)  # ("intra_node" | "inter_node", operation) -> bytes
    wait_seconds: float = 0.0
    device_waits: list[tuple[torch.cuda.Event, torch.cuda.Event]] | None = None

    def clear(self) -> None:
        self.volume.clear()
        self.links.clear()

    def totals(self) -> dict[str, int]:
        keys = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "control")
        totals = dict.fromkeys(keys, 0)
        for (_, op), nbytes in self.volume.items():
            totals[op] = totals.get(op, 0) + int(nbytes)
        return totals

    def by_group(self) -> dict[str, dict[str, int]]:
        groups: dict[str, dict[str, int]] = {}
        for (group, op), nbytes in sorted(self.volume.items()):
            groups.setdefault(group, {})[op] = int(nbytes)
        return groups

    def by_link(self) -> dict[str, dict[str, int]]:
        """{"intra_node": {...}, "inter_node": {...}}: the data collectives' bytes by the link
        they cross ({} when the job runs on one node)."""
        links: dict[str, dict[str, int]] = {}
        for (link, op), nbytes in sorted(self.links.items()):
            links.setdefault(link, {})[op] = int(nbytes)
        return links


def _divide(tensor: torch.Tensor, divisor: float) -> None:
    """`tensor.div_(divisor)`, skipped for 1 (the transports that cannot divide as they copy)."""
    if divisor != 1.0:
        tensor.div_(divisor)


@dataclass
class PendingCollective:
    """Handle to an in-flight collective; `wait()` re-raises failures with context."""

    work: dist.Work | point_to_point.PointToPointWork | None
    op: str
    what: str
    communicator: "Communicator"
    started: float = field(default_factory=time.monotonic)
    record: CollectiveRecord | None = None  # in the flight recorder (flight_recorder.py)

    def wait(self, timeout: datetime.timedelta | None = None) -> None:
        if self.work is None:
            return
        work, self.work = self.work, None
        stats = self.communicator.stats
        timed_on_device = stats.device_waits is not None and self.communicator.device_only
        if timed_on_device:
            stalled_from = torch.cuda.Event(enable_timing=True)
            stalled_from.record()
        blocked_from = time.perf_counter()
        check = watched_check() if timeout is None and not self.communicator.device_only else None
        try:
            if check is not None:  # a gloo wait a peer may abandon (blocked_waits.py)
                finished = wait_watching(work, check, self.communicator.handle.ranks, f"{self.op} of {self.what}")
            else:
                finished = work.wait() if timeout is None else work.wait(timeout)
            if finished is False:
                raise RuntimeError(f"not finished within {timeout.total_seconds():g}s")
        except AbandonedWait:
            if self.record is not None:
                RECORDER.fail(self.record)
            raise
        except Exception as error:  # gloo/NCCL raise RuntimeError subclasses
            if self.record is not None:
                RECORDER.fail(self.record)
            raise self.communicator.error(self.op, self.what, error, self.started) from error
        else:
            if self.record is not None:
                RECORDER.finish(self.record)
        finally:
            stats.wait_seconds += time.perf_counter() - blocked_from
            if timed_on_device:
                stalled_until = torch.cuda.Event(enable_timing=True)
                stalled_until.record()
                stats.device_waits.append((stalled_from, stalled_until))


class Communicator:
    """Counted, error-naming collectives over one group of the mesh.

    A group of one skips every collective: there is nothing to exchange. Test-only switch:
    with SHARDWISE_COLLECTIVES_AT_WORLD_SIZE_1=1 in the environment when the communicator
    is built, and a process group to run on (the group's own, or a default group of one),
    a group of one still issues the real torch.distributed call of each data collective
    (all-reduce, reduce-scatter, all-gather, all-to-all, broadcast), asynchronously, and
    `wait()` waits on its handle. One GPU cannot host two NCCL ranks, so this is how a
    single-GPU machine runs the NCCL call paths: in-place reduce-scatter and all-gather
    into aliasing buffers, async handles, device tensors handed to NCCL. The results are
    the same (a sum over one rank is the identity) and so is the accounting (a ring over
    one rank sends nothing, and nothing is recorded). Control collectives stay skipped:
    they run on gloo, which the multi-rank CPU tests cover. Never set it for training:
    the calls only cost time.
    """

    def __init__(
        self,
        handle: GroupHandle,
        stats: CommStats | None = None,
        ledger: MemoryLedger | None = None,
        peers: PeerDirectory | None = None,
        global_rank: int | None = None,
    ):
        """`ledger` receives the receive buffers of gloo reduce-scatters as "buffers"."""
        self.handle = handle
        self.name = handle.purpose
        self.group = handle.group
        self.control_group = handle.control
        self.rank = handle.rank
        self.size = handle.size
        self.global_rank = handle.ranks[handle.rank] if global_rank is None else global_rank
        self.stats = stats if stats is not None else CommStats()
        self.ledger = ledger if ledger is not None else MemoryLedger()
        self.peers = peers
        # gloo's own reduce-scatter / all-gather copy and all-reduce the whole input
        self.point_to_point = self.size > 1 and dist.get_backend(self.group) == "gloo"
        self._sequence = 0  # tags point-to-point collectives; advances alike on every rank
        # a segment shared with the members, mapped at the first collective that can use it
        # (the members agree on it over the control group)
        self._shared_memory_wanted = (self.point_to_point and self.control_group is not None
                                      and shared_memory.enabled())
        self._shared_memory: shared_memory.SharedMemoryChannel | None = None
        self.skips_collectives = self.size == 1 and not _issues_at_size_one(self.group)
        # CUDA tensors only (also a group of one whose NCCL calls the test switch issues)
        self.device_only = not self.skips_collectives and dist.get_backend(self.group) == "nccl"
        self._recorded_name = handle.describe()

    @property
    def staging_device(self) -> torch.device | None:
        """Where a host tensor must be copied to cross this group (distributed/staging.py):
        the current CUDA device when the group issues NCCL calls; None when it takes
        tensors where they are or issues nothing (a group of one), so no copy is made."""
        return torch.device("cuda", torch.cuda.current_device()) if self.device_only else None

    @property
    def world_size(self) -> int:
        """The group's size (the name the ZeRO code reads as N)."""
        return self.size

    @property
    def wait_seconds(self) -> float:
        return self.stats.wait_seconds

    def error(self, op: str, what: str, cause: BaseException, started: float) -> CollectiveError:
        waited = time.monotonic() - started
        lost = self.peers.describe_lost(self.handle.ranks, cause) if self.peers is not None else ""
        return CollectiveError(
            f"rank {self.global_rank}: {op} of {what} in the {self.handle.describe()} failed after "
            f"{waited:.1f}s: {cause}{lost}. "
            "If ranks run different modules or a different number of steps "
            "(data-dependent branches, uneven data), their collectives no longer pair up."
        )

    def _require_device(self, op: str, what: str, *tensors: torch.Tensor) -> None:
        """NCCL takes CUDA tensors only; anything else fails deep inside it, or hangs the
        peers that did enter the collective. One attribute read when the group is gloo's."""
        if self.device_only:
            for tensor in tensors:
                if tensor.device.type != "cuda":
                    raise ValueError(
                        f"rank {self.global_rank}: {op} of {what} in the {self.handle.describe()}: the group is "
                        f"NCCL's, which moves CUDA tensors only, but this one is on {tensor.device}; move it to "
                        "the device first (distributed/staging.py stages host tensors through it)"
                    )

    # -- accounting ---------------------------------------------------------------
    def _count(self, op: str, nbytes: int, category: str | None = None) -> None:
        if self.size == 1:  # a ring over one rank sends nothing (collectives issued by the test-only switch)
            return
        sent = ring_bytes(op, nbytes, self.size)
        self.stats.volume[(self.name, category or op)] += sent
        nodes = self.handle.nodes
        if nodes is None or category is not None:
            return
        if op == "all_to_all":  # chunk r goes to member r
            away = sum(node != nodes[self.rank] for node in nodes)
            inter = nbytes * away // self.size
        else:  # a ring: everything goes to the successor
            inter = sent if nodes[(self.rank + 1) % self.size] != nodes[self.rank] else 0
        self.stats.links[("inter_node", op)] += inter
        self.stats.links[("intra_node", op)] += sent - inter

    def count_in_place(self, op: str, nbytes: int) -> None:
        """Count a collective whose result the members read where it lies instead of moving
        it (stage 3's parameters shared in memory on one host, zero/shared_param_home.py): the
        ring model's bytes, as every transport counts them, so volumes compare across
        transports and against docs/formulas.md."""
        self._count(op, nbytes)

    def _count_chunks(self, op: str, chunks: list[int]) -> None:
        """Count bytes sent chunk by chunk: `chunks[r]` bytes to member r (none to itself)."""
        if self.size == 1:
            return
        sent = sum(nbytes for member, nbytes in enumerate(chunks) if member != self.rank)
        self.stats.volume[(self.name, op)] += sent
        nodes = self.handle.nodes
        if nodes is None:
            return
        inter = sum(nbytes for member, nbytes in enumerate(chunks) if nodes[member] != nodes[self.rank])
        self.stats.links[("inter_node", op)] += inter
        self.stats.links[("intra_node", op)] += sent - inter

    @staticmethod
    def _bytes(tensor: torch.Tensor) -> int:
        return tensor.numel() * tensor.element_size()

    def _pending(self, work, op: str, what: str) -> PendingCollective:
        return PendingCollective(work, op, what, self)

    def _issue(self, op: str, what: str, start, nbytes: int, *,
               control: bool = False) -> PendingCollective:
        """Start a collective, noted in the flight recorder (the torch.distributed calls
        it makes are not noted again); a failure at issue time is named like one at wait
        time."""
        started = time.monotonic()
        record = RECORDER.issue(self._recorded_name + (", control" if control else ""), self.handle.ranks,
                                op, what, nbytes)
        RECORDER.enter()
        try:
            pending = self._pending(start(), op, what)
        except Exception as error:
            RECORDER.fail(record)
            raise self.error(op, what, error, started) from error
        finally:
            RECORDER.leave()
        pending.record = record
        return pending

    # -- data collectives -----------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, what: str) -> PendingCollective:
        """Sum `tensor` in place over the group."""
        if self.skips_collectives:
            return self._pending(None, "all_reduce", what)
        self._require_device("all_reduce", what, tensor)
        self._count("all_reduce", self._bytes(tensor))
        if tensor.dtype in shared_memory.SUMMED_DTYPES and self._shares_memory("all_reduce", what, tensor):
            channel = self._shared_memory
            return self._issue("all_reduce", what, lambda: channel.all_reduce(tensor), self._bytes(tensor))
        return self._issue("all_reduce", what, lambda: dist.all_reduce(tensor, group=self.group, async_op=True),
                           self._bytes(tensor))

    def reduce_scatter(self, output: torch.Tensor, full: torch.Tensor, what: str, *,
                       divide_by: float = 1.0) -> PendingCollective:
        """Sum `full` / `divide_by` over the group; this rank receives chunk `rank` into `output`.

        `output` may alias `full`'s own chunk (in place), which saves a buffer. Each
        member's values are divided before the sum (the bits of `full.div_(divide_by)`
        followed by the sum, on every transport); the shared-memory transport divides while
        it copies, so `full` is left undivided there: read only `output` afterwards.
        """
        if self.skips_collectives:
            _divide(full, divide_by)
            if output.data_ptr() != full.data_ptr():
                output.copy_(full)
            return self._pending(None, "reduce_scatter", what)
        self._require_device("reduce_scatter", what, output, full)
        self._count("reduce_scatter", self._bytes(full))
        if not self.point_to_point:
            _divide(full, divide_by)
            return self._issue("reduce_scatter", what,
                               lambda: reduce_scatter_single(output, full, group=self.group, async_op=True),
                               self._bytes(full))
        if (full.dtype in shared_memory.SUMMED_DTYPES and full.numel() == output.numel() * self.size
                and self._shares_memory("reduce_scatter", what, output, full)):
            channel = self._shared_memory
            return self._issue("reduce_scatter", what,
                               lambda: channel.reduce_scatter(output, full, divide_by=divide_by), self._bytes(full))
        _divide(full, divide_by)
        receive_bytes = self._bytes(full) * (self.size - 1) // self.size
        self.ledger.hold("buffers", receive_bytes)
        return self._issue("reduce_scatter", what, lambda: point_to_point.reduce_scatter(
            output, full, self.group, self.rank, self.size, self._next_tag(),
            on_free=lambda nbytes: self.ledger.release("buffers", nbytes),
        ), self._bytes(full))

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor, what: str) -> PendingCollective:
        """Concatenate every rank's `shard` into `full` (`shard` may be `full`'s own chunk)."""
        if self.skips_collectives:
            if shard.data_ptr() != full.data_ptr():
                full.copy_(shard)
            return self._pending(None, "all_gather", what)
        self._require_device("all_gather", what, full, shard)
        if self.point_to_point:
            return self.all_gather_pieces(list(full.chunk(self.size)), shard, what)
        self._count("all_gather", self._bytes(full))
        return self._issue("all_gather", what,
                           lambda: all_gather_single(full, shard, group=self.group, async_op=True), self._bytes(full))

    def all_gather_pieces(self, pieces: list[torch.Tensor], shard: torch.Tensor, what: str) -> PendingCollective:
        """All-gather into `pieces[r]` (views anywhere) from each rank's `shard`."""
        if self.skips_collectives:
            if shard.data_ptr() != pieces[0].data_ptr():
                pieces[0].copy_(shard)
            return self._pending(None, "all_gather", what)
        self._require_device("all_gather", what, shard, *pieces)
        full_bytes = sum(self._bytes(piece) for piece in pieces)
        self._count("all_gather", full_bytes)
        if all(piece.numel() == shard.numel() and piece.dtype == shard.dtype for piece in pieces) \
                and self._shares_memory("all_gather", what, shard, *pieces):
            channel = self._shared_memory
            return self._issue("all_gather", what, lambda: channel.all_gather(pieces, shard), full_bytes)
        if self.point_to_point:
            return self._issue("all_gather", what, lambda: point_to_point.all_gather(
                pieces, shard, self.group, self.rank, self.size, self._next_tag()), full_bytes)
        return self._issue("all_gather", what,
                           lambda: dist.all_gather(pieces, shard, group=self.group, async_op=True), full_bytes)

    def all_to_all(self, output: torch.Tensor, tensor: torch.Tensor, what: str) -> PendingCollective:
        """Chunk r of `tensor` goes to rank r; chunk r of `output` comes from rank r
        (Ulysses sequence parallelism, compressed communication)."""
        if self.skips_collectives:
            if output.data_ptr() != tensor.data_ptr():
                output.copy_(tensor)
            return self._pending(None, "all_to_all", what)
        self._require_device("all_to_all", what, output, tensor)
        self._count("all_to_all", self._bytes(tensor))
        return self._issue("all_to_all", what,
                           lambda: dist.all_to_all_single(output, tensor, group=self.group, async_op=True),
                           self._bytes(tensor))

    def all_to_all_uneven(self, output: torch.Tensor, tensor: torch.Tensor, *, output_splits: list[int],
                          input_splits: list[int], what: str) -> PendingCollective:
        """All-to-all of chunks of unequal sizes along dim 0: `input_splits[r]` rows of
        `tensor` go to rank r, `output_splits[r]` rows of `output` come from it (tokens
        routed to experts without a capacity). Counted: the bytes of the rows that leave
        this rank (its own chunk stays)."""
        if self.skips_collectives:
            if output.data_ptr() != tensor.data_ptr():
                output.copy_(tensor)
            return self._pending(None, "all_to_all", what)
        self._require_device("all_to_all", what, output, tensor)
        row = tensor[0].numel() * tensor.element_size() if tensor.dim() > 1 else tensor.element_size()
        self._count_chunks("all_to_all", [rows * row for rows in input_splits])
        return self._issue("all_to_all", what, lambda: dist.all_to_all_single(
            output, tensor, output_split_sizes=output_splits, input_split_sizes=input_splits, group=self.group,
            async_op=True), self._bytes(tensor))

    def broadcast(self, tensor: torch.Tensor, source: int, what: str) -> None:
        """Copy group rank `source`'s `tensor` to every member (blocking)."""
        if self.skips_collectives:
            return
        self._require_device("broadcast", what, tensor)
        self._count("broadcast", self._bytes(tensor))
        self._issue("broadcast", what, lambda: dist.broadcast(
            tensor, group=self.group, group_src=source, async_op=True), self._bytes(tensor)).wait()

    def _shares_memory(self, op: str, what: str, *tensors: torch.Tensor) -> bool:
        """Whether these tensors go through the shared segment: contiguous CPU tensors of a
        gloo group on one host. Maps the segment on first use (every member decides alike:
        the same collective with the same shapes)."""
        if not self._shared_memory_wanted or not all(t.device.type == "cpu" and t.is_contiguous() for t in tensors):
            return False
        if self._shared_memory is None:
            self._shared_memory_wanted = False  # one try: a group that cannot share keeps gloo
            started = time.monotonic()
            try:
                self._shared_memory = shared_memory.shared_channel(
                    self.name, rank=self.rank, global_ranks=self.handle.ranks, timeout=collective_timeout(),
                    gather=lambda value: self.control_all_gather_object(value, counted=False))
            except CollectiveError as error:  # named as the collective being issued
                cause = RuntimeError(f"agreeing on a shared-memory segment: {error.__cause__ or error}")
                raise self.error(op, what, cause, started) from error
            self._shared_memory_wanted = self._shared_memory is not None
        return self._shared_memory is not None

    def _next_tag(self) -> int:
        self._sequence = (self._sequence + 1) % (2**31 - 1)
        return self._sequence

    # -- control collectives ----------------------------------------------------------
    def control_all_reduce(
        self, tensor: torch.Tensor, what: str, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
        timeout: datetime.timedelta | None = None,
    ) -> torch.Tensor:
        """Blocking all-reduce of a small tensor (in place), counted under "control"."""
        if self.size == 1:
            return tensor
        self._count("all_reduce", self._bytes(tensor), category="control")
        on_cpu = tensor.detach().cpu()
        pending = self._issue("all_reduce", what, lambda: dist.all_reduce(
            on_cpu, op=op, group=self.control_group, async_op=True), self._bytes(on_cpu), control=True)
        work = pending.work
        pending.wait(timeout)
        retire(work, on_cpu)  # what gloo's thread must not be the last to free (retired_works.py)
        if tensor.device.type != "cpu":
            tensor.copy_(on_cpu)
        return tensor

    def all_gather_control(self, output: torch.Tensor, tensor: torch.Tensor, what: str, *,
                           counted: bool = True) -> None:
        """Blocking all-gather of a small CPU tensor into `output`, counted under "control"
        unless not `counted`."""
        if self.size == 1:
            output.copy_(tensor)
            return
        if counted:
            self._count("all_gather", self._bytes(output), category="control")
        gathered, mine = output.detach(), tensor.detach()
        pending = self._issue("all_gather", what, lambda: all_gather_single(
            gathered, mine, group=self.control_group, async_op=True), self._bytes(output), control=True)
        work = pending.work
        pending.wait()
        retire(work, gathered, mine)  # what gloo's thread must not be the last to free (retired_works.py)

    def control_all_gather_object(self, value: object, *, counted: bool = True) -> list[object]:
        """Every member's `value` (pickled): for error reports and one-time agreements (the
        shared segment's, not `counted`: it is no part of training's traffic), never on the
        hot path."""
        if self.size == 1:
            return [value]
        # Pickled bytes over the control group's own all-gathers rather than torch's
        # all_gather_object, whose temporaries gloo's threads would free (retired_works.py).
        mine = torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8)
        lengths = torch.zeros(self.size, dtype=torch.int64)
        self.all_gather_control(lengths, torch.tensor([mine.numel()]), "the lengths of pickled values",
                                counted=counted)
        longest = int(lengths.max())
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[:mine.numel()] = mine
        everyone = torch.empty(self.size * longest, dtype=torch.uint8)
        self.all_gather_control(everyone, padded, "pickled values", counted=counted)
        return [pickle.loads(everyone[r * longest:r * longest + int(lengths[r])].numpy().tobytes())
                for r in range(self.size)]

    def barrier(self, what: str) -> None:
        if self.size > 1:
            self.control_all_reduce(torch.zeros(1), what)

    def agree_on_call(self, operation: str, timeout: datetime.timedelta) -> None:
        """Check that every member is entering `operation` now, within `timeout`.

        For collective API calls that user code may wrongly make on some ranks only
        (`if rank == 0: engine.save_checkpoint(...)`): without this, the caller waits in
        the operation's first collective until the collective timeout, or pairs it with
        a different collective of the other ranks. Two codes are reduced with MAX, so
        a difference shows on every rank at once.
        """
        if self.size == 1:
            return
        code = zlib.crc32(operation.encode())
        both = torch.tensor([code, -code], dtype=torch.int64)
        try:
            self.control_all_reduce(both, f"the check that every rank calls {operation}", dist.ReduceOp.MAX, timeout)
        except CollectiveError as error:
            raise MismatchedCallError(
                f"rank {self.global_rank}: {operation} is collective: every rank of the "
                f"{self.handle.describe()} must call it, but not all did within "
                f"{timeout.total_seconds():g}s ({error})"
            ) from error
        if both[0].item() != -both[1].item():
            raise MismatchedCallError(
                f"rank {self.global_rank}: {operation} is collective: every rank of the "
                f"{self.handle.describe()} must call it, but another rank called something else "
                "at the same point"
            )


def _issues_at_size_one(group: dist.ProcessGroup | None) -> bool:
    """The test-only switch (see `Communicator`): on, and a group of one to issue on."""
    if os.environ.get(COLLECTIVES_AT_SIZE_ONE_VARIABLE) != "1" or not dist.is_initialized():
        return False
    return group is not None or dist.get_world_size() == 1  # None: the default group


def mesh_communicator(mesh: ParallelMesh, purpose: str) -> Communicator:
    """A communicator over one of the mesh's groups, counting into the job's statistics
    (`mesh.comm_stats`), so `comm_volume()` shows its bytes."""
    return Communicator(mesh[purpose], mesh.comm_stats)
