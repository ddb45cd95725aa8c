"""A communicator per group: rank and size from its group, broadcasts by group rank (a
group without global rank 0 works), bytes counted per (group, operation), and errors that
name the group (issue: engine architecture, deliverable 2)."""

import time

from shardwise.testing import run_distributed
from tests.distributed.workers import exercise_groups, stall_in_subgroup


def test_broadcast_all_to_all_and_accounting_per_group():
    results = run_distributed(exercise_groups, 4)
    # replicate groups are [0, 2] and [1, 3]: their member 1 is global rank 2 or 3
    assert [r["broadcast"] for r in results] == [2.0, 3.0, 2.0, 3.0]
    assert [r["group_rank"] for r in results] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    # shard groups [0, 1] and [2, 3]: chunk j of rank i goes to rank j
    assert results[0]["all_to_all"] == [0.0, 1.0, 10.0, 11.0]
    assert results[1]["all_to_all"] == [2.0, 3.0, 12.0, 13.0]
    assert results[3]["all_to_all"] == [22.0, 23.0, 32.0, 33.0]
    for result in results:
        # all-to-all of 16 bytes over 2 ranks sends 8; all-reduce of 32 bytes over 2 sends 2 * 16
        assert result["volume"]["shard"] == {"all_to_all": 8}
        assert result["volume"]["replicate"] == {"broadcast": 2, "all_reduce": 32}


def test_a_stalled_collective_names_its_group():
    started = time.monotonic()
    message = run_distributed(stall_in_subgroup, 4, timeout=60, env={"SHARDWISE_COLLECTIVE_TIMEOUT": "2"})[1]
    assert message.startswith("rank 1: all_reduce of a payload in the replicate group (ranks [1, 3]) failed after")
    assert time.monotonic() - started < 30
