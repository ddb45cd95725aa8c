"""The last collectives this process issued, so a hang can say what every rank was doing.

A job that hangs in a collective shows nothing but silence: every rank waits, and the
one that is behind (asleep, stuck in its data loader, or gone down another branch) is
indistinguishable from the ones waiting for it. Like torch's NCCL flight recorder, each
process keeps a small ring of the collectives it issued, each with its group, its
operation, what it moved, its size and its *sequence number within its group*. Every rank
issues the collectives of a group in the same order, so the n-th collective of a group has
number n on every member, and the member whose last number is lowest is the one behind
(`behind`, which the launcher's summary uses: tools/launcher/hang_watch.py).

The recorder is fed by the `Communicator` (collectives.py) and, for plain torch scripts
under `shardwise run`, by torch.distributed's own functions wrapped by
recorded_torch_calls.py. It imports nothing heavy, holds no tensor (holding a collective's
work would keep its buffers alive), and costs one small object and a deque append per
collective. `on_failure`, when set (by the worker side of the launcher's watch), is
called when a collective fails, before the error propagates, so every rank can be asked
for its report while this one is still there to be compared.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

CAPACITY = 64  # enough to see a few steps' pattern; a snapshot stays a few kilobytes


@dataclass(slots=True)
class CollectiveRecord:
    group: str  # names the group identically on every member ("world", "shard group (ranks 0-1)")
    sequence: int  # 1 for the group's first collective from this process
    op: str
    what: str
    nbytes: int
    issued: float  # time.time(): comparable between the processes of one host
    asynchronous: bool = False  # issued with async_op=True outside a Communicator: its end is not seen
    finished: float | None = None
    failed: bool = False

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__slots__}


class FlightRecorder:
    """A ring of `CollectiveRecord`s and the number of collectives issued per group."""

    def __init__(self, capacity: int = CAPACITY):
        self.records: deque[CollectiveRecord] = deque(maxlen=capacity)
        self.groups: dict[str, tuple[int, ...]] = {}  # group name -> its global ranks
        self.sequences: dict[str, int] = {}
        self.changes = 0  # issues and ends so far: a watcher sees progress as this moving
        self.on_failure: Callable[[CollectiveRecord], None] | None = None
        self._outermost = threading.local()  # see `nested`

    def issue(self, group: str, ranks: tuple[int, ...], op: str, what: str, nbytes: int,
              *, asynchronous: bool = False) -> CollectiveRecord:
        sequence = self.sequences.get(group, 0) + 1
        self.sequences[group] = sequence
        if group not in self.groups:
            self.groups[group] = tuple(ranks)
        record = CollectiveRecord(group, sequence, op, what, nbytes, time.time(), asynchronous)
        self.records.append(record)
        self.changes += 1
        return record

    def finish(self, record: CollectiveRecord) -> None:
        record.finished = time.time()
        self.changes += 1

    def fail(self, record: CollectiveRecord) -> None:
        """Mark `record` failed and tell `on_failure` (the caller re-raises afterwards)."""
        record.failed = True
        record.finished = time.time()
        self.changes += 1
        if self.on_failure is not None:
            self.on_failure(record)

    def nested(self) -> bool:
        """True inside another recorded call on this thread: torch's `all_gather_object`
        calls `all_gather`, a Communicator calls torch's functions; only the outermost
        call is recorded, so the numbers count the same calls on every rank."""
        return getattr(self._outermost, "depth", 0) > 0

    def enter(self) -> None:
        self._outermost.depth = getattr(self._outermost, "depth", 0) + 1

    def leave(self) -> None:
        self._outermost.depth -= 1

    def snapshot(self) -> dict:
        """Plain data (JSON) for the launcher: the ring, oldest first, and the groups."""
        return {
            "changes": self.changes,
            "groups": {name: {"ranks": list(ranks), "issued": self.sequences[name]}
                       for name, ranks in self.groups.items()},
            "records": [record.as_dict() for record in list(self.records)],
        }


RECORDER = FlightRecorder()  # one per process: the collectives of every group and thread


def describe_record(record: dict, now: float) -> str:
    """`#12 all_reduce of gradients (4.0 KiB) in world: waiting for 6.1s` and the like."""
    state = ("failed" if record["failed"] else f"finished in {record['finished'] - record['issued']:.2f}s"
             if record["finished"] is not None else "issued asynchronously"
             if record["asynchronous"] else f"waiting for {now - record['issued']:.1f}s")
    what = f" of {record['what']}" if record["what"] else ""
    return f"#{record['sequence']} {record['op']}{what} ({_size(record['nbytes'])}) in {record['group']}: {state}"


def behind(snapshots: dict[int, dict | None]) -> list[str]:
    """Sentences naming, per group, the members that issued fewer of its collectives than
    another member (the ones the others wait for), from every rank's `snapshot()` (None:
    that rank never reported). Empty when no member of any group is behind another."""
    groups: dict[str, tuple[int, ...]] = {}
    for snapshot in snapshots.values():
        for name, group in (snapshot or {}).get("groups", {}).items():
            groups.setdefault(name, tuple(group["ranks"]))
    sentences = []
    for name, ranks in sorted(groups.items()):
        issued = {rank: _issued(snapshots.get(rank), name) for rank in ranks}
        known = {rank: count for rank, count in issued.items() if count is not None}
        if not known:
            continue
        most = max(known.values())
        lagging = [rank for rank, count in known.items() if count < most]
        silent = [rank for rank, count in issued.items() if count is None]
        if not lagging and not silent:
            continue
        leaders = [rank for rank, count in known.items() if count == most]
        parts = [f"rank {rank} issued {known[rank]}" for rank in lagging]
        parts += [f"rank {rank} never reported" for rank in silent]
        sentences.append(
            f"in {name}, {_ranks(leaders)} issued {most} collective(s) and wait(s) for "
            f"{_ranks(lagging + silent)}: {', '.join(parts)}"
        )
    return sentences


def _issued(snapshot: dict | None, group: str) -> int | None:
    if snapshot is None:
        return None
    return snapshot["groups"].get(group, {}).get("issued", 0)


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _size(nbytes: int) -> str:
    if nbytes < 1024:
        return f"{nbytes} B"
    scaled, unit = nbytes / 1024, "KiB"
    for larger in ("MiB", "GiB"):
        if scaled >= 1024:
            scaled, unit = scaled / 1024, larger
    return f"{scaled:.1f} {unit}"
