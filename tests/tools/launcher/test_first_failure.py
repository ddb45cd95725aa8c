"""`shardwise run`'s one line on the rank that failed first (tools/launcher/cli.py
`first_failure`), from torchrun's failure records, whose times are whole seconds."""

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from shardwise.tools.launcher.cli import first_failure


def failure(tmp_path, rank: int, *, timestamp: int, exitcode: int, message: str = "") -> ProcessFailure:
    record = ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(tmp_path / "none"))
    record.timestamp = timestamp
    if message:
        record.message, record.error_file_data = message, {"message": message}
    return record


def test_a_rank_stopped_by_sigterm_in_the_same_second_comes_after_the_one_that_raised(tmp_path):
    failures = {0: failure(tmp_path, 0, timestamp=100, exitcode=1,
                           message="Signal 15 (SIGTERM) received by PID 1000"),
                1: failure(tmp_path, 1, timestamp=100, exitcode=1, message="ValueError: bad batch 7")}
    assert first_failure(failures) == "shardwise run: rank 1 failed first: ValueError: bad batch 7 (rank(s) 0 failed too)"
    failures[0] = failure(tmp_path, 0, timestamp=100, exitcode=-15)  # no error file: killed outright
    assert first_failure(failures).startswith("shardwise run: rank 1 failed first: ValueError")


def test_an_earlier_second_wins_whatever_the_cause(tmp_path):
    failures = {0: failure(tmp_path, 0, timestamp=99, exitcode=-15),
                1: failure(tmp_path, 1, timestamp=100, exitcode=1, message="ValueError: bad batch 7")}
    assert first_failure(failures) == ("shardwise run: rank 0 failed first: Signal 15 (SIGTERM) received by PID 1000 "
                                      "(rank(s) 1 failed too)")
