"""The launcher's hang watch: when a worker's collective fails, or when a worker has made no
progress for `--hang-timeout` seconds, every worker reports what it was doing and one line
names the rank that is behind.

The workers (worker_watch.py) keep their flight recorder's snapshot in a folder this
watch creates; a thread here reads it four times a second. A worker's clock starts at its
first collective (start-up, data loading and compilation before it are not a hang), and
progress is any collective issued or ended. When the watch fires it sends each worker
SIGUSR1 (faulthandler writes its Python stacks), prints per rank its last collectives and
its stacks; the launcher ends with the summary from the sequence numbers per group
(runtime/distributed/flight_recorder.py `behind`), after torchrun's own lines. On no progress it then stops the
workers (SIGTERM), so a hung job ends within the timeout instead of at the collective
timeout or never; on a failed collective the failing rank's own error ends the job.

It watches the workers of this node: in a multi-node job each node's launcher reports its
own ranks, and a rank of another node shows as sending no report.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from shardwise.runtime.distributed.flight_recorder import behind, describe_record
from shardwise.tools.launcher.worker_watch import (
    COLLECTED, HANG_DIR_ENV, REPORT_SIGNAL, failed_path, stack_path,
)

HANG_TIMEOUT_ENV = "SHARDWISE_HANG_TIMEOUT"
POLL_SECONDS = 0.25
STACK_WAIT_SECONDS = 3.0  # for every worker's faulthandler to write its stacks
STACK_SETTLE_SECONDS = 0.5  # a stack file that has not grown for this long is complete
RECENT = 6  # collectives shown per rank
_SNAPSHOT_THREAD = re.compile(r'launcher/worker_watch\.py", line \d+ in run\n')
# a failed collective's rank waits in worker_watch.py for this report, under flight_recorder.py
_LAUNCHER_FRAMES = ("<frozen runpy>", "launcher/child.py", "launcher/worker_watch.py",
                    "distributed/flight_recorder.py")


class HangWatch:
    """Use as a context manager around the agent; `summary` is set once it fired."""

    def __init__(self, *, no_progress_seconds: float | None):
        self.no_progress_seconds = no_progress_seconds
        self.folder = Path(tempfile.mkdtemp(prefix="shardwise-hang-"))
        self.summary: str | None = None
        self.stopped_job = False  # the watch ended the workers (no progress)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="shardwise-hang-watch", daemon=True)

    def environment(self) -> dict[str, str]:
        """What the workers need to take part (watch_this_worker reads it)."""
        return {HANG_DIR_ENV: str(self.folder)}

    def __enter__(self) -> HangWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stopped.set()
        self._thread.join()
        shutil.rmtree(self.folder, ignore_errors=True)

    def _watch(self) -> None:
        progress: dict[int, tuple[int, float]] = {}  # rank -> (changes, when they last moved)
        while not self._stopped.wait(POLL_SECONDS):
            snapshots = self._snapshots()
            failed = sorted(self.folder.glob("rank*.failed"))
            if failed:
                rank = int(failed[0].stem.removeprefix("rank"))
                self._fire(f"rank {rank}'s {failed[0].read_text()} failed", snapshots, stop=False)
                return
            now = time.time()
            for rank, snapshot in snapshots.items():
                if snapshot["changes"] and progress.get(rank, (None, 0.0))[0] != snapshot["changes"]:
                    progress[rank] = (snapshot["changes"], _last_moved(snapshot) or now)
            if self.no_progress_seconds is None:
                continue
            stalled = [rank for rank, (_, since) in progress.items() if now - since >= self.no_progress_seconds]
            if stalled:
                ranks = ", ".join(map(str, sorted(stalled)))
                self._fire(f"no progress from rank(s) {ranks} for {self.no_progress_seconds:g}s "
                           f"(--hang-timeout)", snapshots, stop=True)
                return

    def _snapshots(self) -> dict[int, dict]:
        snapshots = {}
        for path in self.folder.glob("rank*.json"):
            try:
                snapshot = json.loads(path.read_text())
            except (OSError, ValueError):  # replaced meanwhile: the next poll reads it
                continue
            snapshots[snapshot["rank"]] = snapshot
        return snapshots

    def _fire(self, reason: str, snapshots: dict[int, dict], *, stop: bool) -> None:
        for snapshot in snapshots.values():
            _signal(snapshot["pid"], REPORT_SIGNAL)
        deadline = time.monotonic() + STACK_WAIT_SECONDS
        sizes: dict[int, tuple[int, float]] = {}  # per rank: its stack file's size, and since when
        while time.monotonic() < deadline and not all(self._stacks_settled(rank, sizes) for rank in snapshots):
            time.sleep(0.05)
        snapshots = {**snapshots, **self._snapshots()}
        self.summary = _summary(reason, snapshots)
        print(self._report(reason, snapshots), file=sys.stderr, flush=True)
        (self.folder / COLLECTED).touch()
        if stop:
            self.stopped_job = True
            for snapshot in snapshots.values():
                _signal(snapshot["pid"], signal.SIGTERM)

    def _stacks_written(self, rank: int) -> bool:
        path = stack_path(self.folder, rank)
        return path.exists() and path.stat().st_size > 0

    def _stacks_settled(self, rank: int, sizes: dict[int, tuple[int, float]]) -> bool:
        """The rank's stacks are written and their file has not grown for STACK_SETTLE_SECONDS:
        faulthandler writes them from its signal handler, which a loaded machine can
        deschedule half-way (a report once showed a rank's stacks cut after "Thread 0x")."""
        if not self._stacks_written(rank):
            return False
        size, now = stack_path(self.folder, rank).stat().st_size, time.monotonic()
        if sizes.get(rank, (None, 0.0))[0] != size:
            sizes[rank] = (size, now)
        return now - sizes[rank][1] >= STACK_SETTLE_SECONDS

    def _report(self, reason: str, snapshots: dict[int, dict]) -> str:
        now = time.time()
        lines = [f"shardwise run: hang report: {reason}; what every rank was doing:"]
        for rank in sorted(snapshots):
            snapshot = snapshots[rank]
            lines.append(f"--- rank {rank} (pid {snapshot['pid']}): last collectives, oldest first:")
            records = snapshot["records"][-RECENT:]
            lines += [f"    {describe_record(record, now)}" for record in records] or ["    (none yet)"]
            if failed_path(self.folder, rank).exists():
                lines.append("    (this rank's collective failed: its own error follows)")
            stacks = stack_path(self.folder, rank).read_text() if self._stacks_written(rank) else ""
            lines.append(f"--- rank {rank}: Python stacks:")
            lines += [f"    {line}" for line in _script_stacks(stacks)] or ["    (not written in time)"]
        return "\n".join(lines)


def _script_stacks(text: str) -> list[str]:
    """faulthandler's stacks without what the launcher adds to every worker: the thread
    writing snapshots, the frames of launcher/child.py and runpy under the script, and a
    failed collective's wait for this report."""
    lines = []
    for block in text.strip().split("\n\n"):
        if _SNAPSHOT_THREAD.search(block):
            continue
        lines += [line for line in block.splitlines() if not any(frame in line for frame in _LAUNCHER_FRAMES)]
    return lines


def _summary(reason: str, snapshots: dict[int, dict]) -> str:
    sentences = behind(snapshots)
    if sentences:
        return f"shardwise run: hang summary ({reason}): {'; '.join(sentences)}"
    return (f"shardwise run: hang summary ({reason}): no rank is behind another in any group (each issued as "
            "many collectives as its peers): compare the last collectives and stacks above (mismatched sizes or "
            "operations, or a rank busy outside collectives)")


def _last_moved(snapshot: dict) -> float | None:
    """When the rank last issued or ended a collective, by its own records (time.time(),
    comparable between the processes of one host): a snapshot reaches the watch up to a
    poll or more after the event, so the time it is seen would let a rank that moved last
    look stalled first."""
    times = [record["finished"] if record["finished"] is not None else record["issued"]
             for record in snapshot["records"]]
    return max(times) if times else None


def no_progress_seconds(flag: float | None) -> float | None:
    """The --hang-timeout flag, else SHARDWISE_HANG_TIMEOUT, else None (off)."""
    if flag is not None:
        return flag
    text = os.environ.get(HANG_TIMEOUT_ENV)
    if not text:
        return None
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"{HANG_TIMEOUT_ENV}={text!r} is not a timeout: give a positive number of seconds")
    return seconds


def _signal(pid: int, number: int) -> None:
    try:
        os.kill(pid, number)
    except ProcessLookupError:
        pass  # exited meanwhile
