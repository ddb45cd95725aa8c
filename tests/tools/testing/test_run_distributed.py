"""run_distributed: results come back by rank, and every way a rank can fail is reported fast."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
import torch
import torch.distributed as dist

from shardwise.tools.testing import DistributedTestError, run_distributed


def rank_processes() -> list[psutil.Process]:
    """Ranks are forked by the fork server (a child of this process): they are grandchildren.

    The fork server and multiprocessing's resource tracker, direct children, live on by design.
    """
    return [
        grandchild
        for child in psutil.Process().children()
        for grandchild in child.children(recursive=True)
    ]


@pytest.fixture(autouse=True)
def no_rank_outlives_its_test():
    yield
    leftovers = rank_processes()
    assert leftovers == [], f"rank processes left behind: {leftovers}"


def describe_rank(rank: int, world_size: int, offset: int, *, scale: int) -> dict:
    return {
        "rank": rank,
        "world_size": world_size,
        "value": (rank + offset) * scale,
        "group": (dist.get_rank(), dist.get_world_size(), dist.get_backend()),
        "env": {name: os.environ[name] for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")},
        "threads": torch.get_num_threads(),
    }


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_returns_each_ranks_value_in_rank_order(world_size):
    results = run_distributed(describe_rank, world_size, 10, scale=3)

    assert [result["rank"] for result in results] == list(range(world_size))
    for rank, result in enumerate(results):
        assert result["world_size"] == world_size
        assert result["value"] == (rank + 10) * 3
        assert result["group"] == (rank, world_size, "gloo")
        assert result["env"] == {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
        }
        assert result["threads"] == 1


def sum_of_ranks(rank: int, world_size: int) -> float:
    tensor = torch.tensor([float(rank + 1)])
    dist.all_reduce(tensor)
    return tensor.item()


@pytest.mark.parametrize("world_size", [2, 4])
def test_all_reduce_sums_over_ranks(world_size):
    assert run_distributed(sum_of_ranks, world_size) == [world_size * (world_size + 1) / 2] * world_size


def read_environment(rank: int, world_size: int) -> dict:
    names = ("SHARDWISE_COLLECTIVE_TIMEOUT", "SHARDWISE_TEST_MARKER", "MASTER_ADDR", "MASTER_PORT")
    return {name: os.environ.get(name) for name in names}


def test_environment_carries_env_argument_and_a_collective_timeout_below_the_run_timeout():
    first, second = run_distributed(read_environment, 2, timeout=8.0, env={"SHARDWISE_TEST_MARKER": "given"})

    assert first == second
    assert first["SHARDWISE_TEST_MARKER"] == "given"
    assert first["SHARDWISE_COLLECTIVE_TIMEOUT"] == "4"
    assert first["MASTER_ADDR"] == "127.0.0.1"
    assert 0 < int(first["MASTER_PORT"]) < 65536
    assert run_distributed(read_environment, 1)[0]["SHARDWISE_COLLECTIVE_TIMEOUT"] == "30"


def reads_inherited_variable(rank: int, world_size: int) -> str | None:
    return os.environ.get("SHARDWISE_TEST_INHERITED")


def test_ranks_see_the_parents_environment_as_it_is_now(monkeypatch):
    monkeypatch.setenv("SHARDWISE_TEST_INHERITED", "set-after-the-fork-server-started")
    assert run_distributed(reads_inherited_variable, 2) == ["set-after-the-fork-server-started"] * 2


def rank_one_raises(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank one is broken")
    dist.all_reduce(torch.ones(1))  # the other ranks block here until stopped


def test_a_raising_rank_fails_the_run_at_once_with_its_traceback():
    started = time.monotonic()
    with pytest.raises(DistributedTestError) as caught:
        run_distributed(rank_one_raises, 3, timeout=60.0)
    elapsed = time.monotonic() - started

    message = str(caught.value)
    assert "rank 1 raised ValueError: rank one is broken" in message
    assert "Traceback (most recent call last)" in message
    assert "in rank_one_raises" in message
    assert caught.value.ranks == [1]
    assert elapsed < 5.0


def test_a_process_group_that_does_not_form_is_started_once_more_then_reported(monkeypatch):
    """A group that fails to form (here: a backend this torch lacks; on a loaded machine,
    gloo closing a loopback pair) is relaunched once before it is reported; a failure in
    the function itself is reported at once."""
    from shardwise.tools.testing import harness

    launches = []
    launch = harness._launch

    def counting(*arguments, **options):
        launches.append(1)
        return launch(*arguments, **options)

    monkeypatch.setattr(harness, "_launch", counting)
    with pytest.raises(DistributedTestError, match="the mpi process group did not form") as caught:
        run_distributed(sum_of_ranks, 2, backend="mpi")
    assert caught.value.before_start and len(launches) == 2
    launches.clear()
    with pytest.raises(DistributedTestError) as caught:
        run_distributed(rank_one_raises, 2)
    assert not caught.value.before_start and len(launches) == 1


def rank_one_exits(rank: int, world_size: int) -> None:
    if rank == 1:
        os._exit(7)
    dist.all_reduce(torch.ones(1))


def test_a_rank_that_exits_without_raising_is_named_with_its_exit_code():
    started = time.monotonic()
    with pytest.raises(DistributedTestError) as caught:
        run_distributed(rank_one_exits, 2, timeout=60.0)
    elapsed = time.monotonic() - started

    assert str(caught.value).startswith("rank 1 exited with code 7 before returning")
    assert caught.value.ranks[0] == 1
    assert elapsed < 5.0


def rank_one_is_killed(rank: int, world_size: int) -> None:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1))


def test_a_rank_killed_by_a_signal_is_named_with_the_signal():
    started = time.monotonic()
    with pytest.raises(DistributedTestError) as caught:
        run_distributed(rank_one_is_killed, 2, timeout=60.0)
    elapsed = time.monotonic() - started

    assert str(caught.value).startswith("rank 1 was killed by SIGKILL (exit code -9) before returning")
    assert elapsed < 5.0


def sleeps(rank: int, world_size: int) -> None:
    time.sleep(60)


def test_a_hang_times_out_naming_the_ranks_still_running():
    started = time.monotonic()
    with pytest.raises(DistributedTestError) as caught:
        run_distributed(sleeps, 2, timeout=1.5)
    elapsed = time.monotonic() - started

    assert str(caught.value) == "timed out after 1.5 s; still running: rank 0, rank 1 (finished: none)"
    assert caught.value.ranks == [0, 1]
    assert 1.5 <= elapsed < 4.0


def rank_zero_returns_early(rank: int, world_size: int) -> str:
    if rank == 0:
        return "done"
    time.sleep(60)
    return "never"


def test_a_timeout_lists_finished_and_running_ranks_separately():
    with pytest.raises(DistributedTestError, match=r"still running: rank 1 \(finished: rank 0\)$"):
        run_distributed(rank_zero_returns_early, 2, timeout=1.0)


def returns_a_lock(rank: int, world_size: int):
    import threading

    return threading.Lock()


def test_an_unpicklable_return_value_is_reported_as_that_ranks_error():
    expected = r"rank 0 raised TypeError: the return value \(lock\) cannot be pickled back to the parent"
    with pytest.raises(DistributedTestError, match=expected):
        run_distributed(returns_a_lock, 1)


def test_bad_arguments_are_rejected_before_starting_anything():
    with pytest.raises(TypeError, match="module-level function"):
        run_distributed(lambda rank, world_size: None, 2)
    with pytest.raises(ValueError, match="world_size must be a positive int, got 0"):
        run_distributed(sum_of_ranks, 0)
    with pytest.raises(ValueError, match="env may not set MASTER_PORT, RANK"):
        run_distributed(sum_of_ranks, 2, env={"RANK": "3", "MASTER_PORT": "1"})
    with pytest.raises(TypeError, match="run_distributed arguments must be picklable"):
        run_distributed(describe_rank, 2, offset=lambda: 0)


def prints_its_rank(rank: int, world_size: int) -> None:
    print(f"output of rank {rank}", flush=True)


def test_rank_output_reaches_the_callers_stdout(capfd):
    run_distributed(prints_its_rank, 2)
    out = capfd.readouterr().out
    assert "output of rank 0" in out and "output of rank 1" in out


def scales_in_place(rank: int, world_size: int, tensor: torch.Tensor) -> torch.Tensor:
    tensor.mul_(rank + 2)
    dist.barrier()  # every rank has scaled its tensor before any returns
    return tensor


def test_tensors_travel_by_value_in_both_directions():
    original = torch.arange(4.0)
    results = run_distributed(scales_in_place, 2, original)

    torch.testing.assert_close(results[0], torch.arange(4.0) * 2)
    torch.testing.assert_close(results[1], torch.arange(4.0) * 3)
    torch.testing.assert_close(original, torch.arange(4.0))
