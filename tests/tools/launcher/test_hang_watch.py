"""The hang watch reads a rank's stacks only once faulthandler has finished writing them
(tools/launcher/hang_watch.py): a loaded machine can deschedule the signal handler
half-way, and a report once showed a rank's stacks cut after "Thread 0x"."""

import shutil
import time

from shardwise.tools.launcher.hang_watch import STACK_SETTLE_SECONDS, HangWatch
from shardwise.tools.launcher.worker_watch import stack_path


def test_a_stack_file_counts_once_it_has_stopped_growing():
    watch = HangWatch(no_progress_seconds=None)
    try:
        sizes: dict = {}
        path = stack_path(watch.folder, 1)
        assert not watch._stacks_settled(1, sizes)  # not written yet
        path.write_text("Thread 0x")
        assert not watch._stacks_settled(1, sizes)  # written just now: maybe half-way
        time.sleep(STACK_SETTLE_SECONDS / 2)
        path.write_text("Thread 0x00007f (most recent call first):\n  File \"sleeper.py\", line 12 in <module>\n")
        assert not watch._stacks_settled(1, sizes)  # it grew: the wait starts again
        time.sleep(STACK_SETTLE_SECONDS + 0.05)
        assert watch._stacks_settled(1, sizes)
    finally:
        shutil.rmtree(watch.folder, ignore_errors=True)
