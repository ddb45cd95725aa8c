"""Hangs that explain themselves (reliability issue 30, item 2): under `shardwise run`, a
job in which one rank stops while the other waits in a collective ends with every rank's
Python stack and last collectives, and one line naming the rank that is behind, both when
the launcher sees no progress for --hang-timeout seconds and when the collective times
out. Real launcher processes with two gloo workers running plain torch scripts."""

from __future__ import annotations

import re
import textwrap
import time

from tests.tools.launcher.test_launcher import run_shardwise

# Rank 1 takes part in 3 all-reduces, then sleeps; rank 0 waits in the 4th.
SLEEPER = textwrap.dedent(
    """
    import datetime, os, sys, time
    import torch
    import torch.distributed as dist
    from torch.distributed import all_reduce  # bound before any wrapping could happen later

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(sys.argv[1])))
    total = torch.ones(256)
    for _ in range(3):
        all_reduce(total)
    if dist.get_rank() == 1:
        time.sleep(60)
    dist.all_reduce(total)
    print("ran to the end")
    """
)


def assert_stacks_show_where_each_rank_is(err: str) -> None:
    """Rank 1 in `time.sleep` (line 12 of the script), rank 0 in the 4th all-reduce (line 13)."""
    rank_1 = err.index("--- rank 1: Python stacks:")
    rank_0 = err.index("--- rank 0: Python stacks:")
    assert rank_0 < rank_1, err
    assert 'sleeper.py", line 13 in <module>' in err[rank_0:rank_1], err
    assert 'sleeper.py", line 12 in <module>' in err[rank_1:], err


def test_no_progress_ends_the_job_and_names_the_sleeping_rank(tmp_path):
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)

    started = time.monotonic()
    finished = run_shardwise(["--nproc", "2", "--hang-timeout", "3", str(script), "120"], tmp_path)
    took = time.monotonic() - started

    assert finished.returncode == 1, finished.stderr
    assert "ran to the end" not in finished.stdout
    # start-up of two ranks (slow on a loaded machine), 3 s of no progress, the report: well
    # short of the 120 s sleep the job would otherwise wait out
    assert took < 100, took
    err = finished.stderr
    last = err.rstrip().splitlines()[-1]
    # rank 1 (asleep) stalls first; rank 0 (waiting in #4) is named with it when both stalls
    # fall in the same poll, which a loaded machine can split
    stalled = re.match(r"shardwise run: hang summary \(no progress from rank\(s\) ([0-9, ]+) for 3s", last)
    assert stalled and "1" in stalled.group(1).split(", "), err
    assert "in world, rank 0 issued 4 collective(s) and wait(s) for rank 1: rank 1 issued 3" in last, err
    # every rank reported its stack and its collectives
    assert "--- rank 0 (pid" in err and "--- rank 1 (pid" in err, err
    assert "#4 all_reduce (1.0 KiB) in world: waiting for" in err, err
    assert "#3 all_reduce (1.0 KiB) in world: finished in" in err, err
    assert_stacks_show_where_each_rank_is(err)
    assert "FAILED" not in err  # torchrun's report of workers the watch itself stopped is left out


def test_a_collective_timeout_reports_every_rank_and_names_the_sleeping_rank(tmp_path):
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)

    finished = run_shardwise(["--nproc", "2", str(script), "3"], tmp_path)

    assert finished.returncode == 1, finished.stderr
    err = finished.stderr
    assert "shardwise run: hang report: rank 0's all_reduce #4 in world failed" in err, err
    assert_stacks_show_where_each_rank_is(err)
    assert "shardwise run: rank 0 failed first:" in err, err
    last = err.rstrip().splitlines()[-1]
    assert "in world, rank 0 issued 4 collective(s) and wait(s) for rank 1: rank 1 issued 3" in last, err


def test_a_bad_hang_timeout_is_refused(tmp_path):
    script = tmp_path / "nothing.py"
    script.write_text("")

    finished = run_shardwise(["--nproc", "2", "--hang-timeout", "0", str(script)], tmp_path)

    assert finished.returncode == 2
    assert "--hang-timeout: expected a positive number of seconds, got '0'" in finished.stderr
