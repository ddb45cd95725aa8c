"""The flight recorder (distributed/flight_recorder.py): what the Communicator notes per
collective, and how the rank that is behind is found from every rank's snapshot."""

from shardwise.runtime.distributed.flight_recorder import FlightRecorder, behind, describe_record
from shardwise.tools.testing import run_distributed
from tests.runtime.distributed.workers import record_a_stall


def test_the_communicator_records_group_size_sequence_and_the_failed_collective():
    # over gloo: a shared-memory segment's one-time agreement would come first in the records
    snapshots = dict(enumerate(run_distributed(record_a_stall, 4, timeout=60, env={"SHARDWISE_SHARED_MEMORY": "0"})))

    shard = {rank: "shard group (ranks 0-1)" if rank < 2 else "shard group (ranks 2-3)" for rank in range(4)}
    for rank, snapshot in snapshots.items():
        group = shard[rank]
        assert snapshot["groups"][group]["ranks"] == ([0, 1] if rank < 2 else [2, 3])
        assert snapshot["groups"][f"{group}, control"]["issued"] == 1  # the barrier, on the control group
        first = snapshot["records"][0]
        assert (first["group"], first["sequence"], first["op"], first["what"], first["nbytes"]) == (
            group, 1, "all_reduce", "ones", 64)
        assert first["finished"] is not None and not first["failed"]
    assert [snapshots[rank]["groups"][shard[rank]]["issued"] for rank in range(4)] == [2, 2, 3, 2]
    last = snapshots[2]["records"][-1]
    assert (last["sequence"], last["what"], last["failed"]) == (3, "the third", True)
    assert behind(snapshots) == [
        "in shard group (ranks 2-3), rank 2 issued 3 collective(s) and wait(s) for rank 3: rank 3 issued 2"
    ]


def test_behind_names_ranks_that_never_reported_and_nothing_when_all_agree():
    recorder = FlightRecorder(capacity=2)
    for _ in range(3):
        recorder.finish(recorder.issue("world", (0, 1, 2), "all_reduce", "", 2048))
    snapshot = recorder.snapshot()
    assert [record["sequence"] for record in snapshot["records"]] == [2, 3]  # a ring of two
    assert behind({0: snapshot, 1: snapshot, 2: snapshot}) == []
    assert behind({0: snapshot, 1: snapshot}) == [
        "in world, ranks 0, 1 issued 3 collective(s) and wait(s) for rank 2: rank 2 never reported"
    ]
    waiting = recorder.issue("world", (0, 1, 2), "broadcast", "weights", 3 * 2**20)
    assert describe_record(recorder.snapshot()["records"][-1], now=waiting.issued + 2.5) == (
        "#4 broadcast of weights (3.0 MiB) in world: waiting for 2.5s")
