"""A worker's side of the launcher's hang watch (hang_watch.py has the launcher's).

`shardwise run` starts every worker through launcher/child.py, which calls
`watch_this_worker` before the script starts, when the launcher passed a folder in
SHARDWISE_HANG_DIR. That is the cleanest place for the hook: the launcher already owns
that code path, so no sitecustomize or PYTHONPATH shim has to be slipped into the user's
environment, nothing happens for a script run without the launcher, and the script still
runs unmodified. The worker then

- notes torch.distributed's collectives in the flight recorder
  (runtime/distributed/recorded_torch_calls.py), installed the moment `torch` has been
  imported (an import hook), so a script that never imports torch pays nothing and one
  that does `from torch.distributed import all_reduce` gets the recorded function;
- writes the recorder's snapshot to `rank<R>.json` in that folder whenever it changed
  (checked 5 times a second by a daemon thread), which is how the launcher sees progress
  and compares sequence numbers;
- has `faulthandler` write every thread's Python stack to `rank<R>.stack` when the
  launcher sends SIGUSR1: done by the signal handler in C, it works while the main thread
  is blocked inside a collective or asleep;
- on a failed collective (a timeout), writes its snapshot and `rank<R>.failed` at once and
  waits a few seconds for the launcher to collect every rank's report before the error
  goes on to end the process.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import threading
import time
from pathlib import Path

from shardwise.runtime.distributed.flight_recorder import RECORDER, CollectiveRecord
from shardwise.tools.launcher.torch_import import after_torch_import

HANG_DIR_ENV = "SHARDWISE_HANG_DIR"
REPORT_SIGNAL = signal.SIGUSR1
COLLECTED = "collected"  # the launcher's answer to a `.failed` file
SNAPSHOT_SECONDS = 0.2
COLLECT_WAIT_SECONDS = 10.0  # how long a failed collective waits for the launcher's report


def snapshot_path(folder: Path, rank: int) -> Path:
    return folder / f"rank{rank}.json"


def stack_path(folder: Path, rank: int) -> Path:
    return folder / f"rank{rank}.stack"


def failed_path(folder: Path, rank: int) -> Path:
    return folder / f"rank{rank}.failed"


def watch_this_worker() -> None:
    """Set this worker up for the launcher's hang watch; a no-op without SHARDWISE_HANG_DIR."""
    folder_text = os.environ.pop(HANG_DIR_ENV, None)  # not for processes this one starts
    if folder_text is None or "RANK" not in os.environ:
        return
    folder, rank = Path(folder_text), int(os.environ["RANK"])
    stacks = open(stack_path(folder, rank), "w")  # noqa: SIM115 - faulthandler writes to it until exit
    faulthandler.register(REPORT_SIGNAL, file=stacks, all_threads=True)
    writer = _SnapshotWriter(folder, rank)
    RECORDER.on_failure = writer.report_failure
    threading.Thread(target=writer.run, name="shardwise-flight-recorder", daemon=True).start()
    after_torch_import(_record_torch)


def _record_torch() -> None:
    import torch.distributed as dist

    if dist.is_available():
        from shardwise.runtime.distributed.recorded_torch_calls import record_torch_collectives

        record_torch_collectives()


class _SnapshotWriter:
    def __init__(self, folder: Path, rank: int):
        self.folder, self.rank = folder, rank
        self.written = -1
        self.lock = threading.Lock()

    def run(self) -> None:
        while True:
            if RECORDER.changes != self.written:
                self.write()
            time.sleep(SNAPSHOT_SECONDS)

    def write(self) -> None:
        with self.lock:
            changes = RECORDER.changes
            snapshot = {"rank": self.rank, "pid": os.getpid(), **RECORDER.snapshot()}
            path = snapshot_path(self.folder, self.rank)
            temporary = path.with_suffix(".tmp")
            temporary.write_text(json.dumps(snapshot))
            os.replace(temporary, path)  # the launcher never reads half a file
            self.written = changes

    def report_failure(self, record: CollectiveRecord) -> None:
        """Tell the launcher, then give it time to collect every rank's stack while this
        rank's peers are still where the failure found them."""
        self.write()
        failed_path(self.folder, self.rank).write_text(f"{record.op} #{record.sequence} in {record.group}")
        deadline = time.monotonic() + COLLECT_WAIT_SECONDS
        while not (self.folder / COLLECTED).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
