"""Engines built and destroyed one after another in the same processes keep the number of
process groups and threads bounded (group_cache.py): DeepSpeed's unit tests, a notebook or
a sweep build dozens of engines in the same worker processes."""

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import shardwise
from shardwise.runtime.distributed.group_cache import shared_groups
from shardwise.tools.testing import run_distributed

ZERO_LAYOUTS = [
    {"stage": 1},
    {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    {"stage": 3},
    {"stage": 0},  # another layout: gradients all-reduced over a replicate group
]
ROUNDS = 3


def _live_threads() -> int:
    return len(os.listdir("/proc/self/task"))  # gloo's threads are native: threading does not see them


def _live_groups() -> int:
    return len(dist.distributed_c10d._world.pg_map)


def _train_and_destroy(zero: dict, save_dir: Path | None) -> float:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
              "zero_optimization": zero}
    engine = shardwise.initialize(model, config)
    for _ in range(2):
        loss = engine(torch.randn(1, 8)).square().sum()
        engine.backward(loss)
        engine.step()
    if save_dir is not None:  # the asynchronous writer has a process group of its own
        engine.save_checkpoint(save_dir, asynchronous=True)
    engine.destroy()
    return loss.item()


def _build_and_destroy_engines(rank: int, world_size: int, root: str) -> dict:
    counts = []
    for round_ in range(ROUNDS):
        for index, zero in enumerate(ZERO_LAYOUTS):
            save_dir = Path(root) / f"round{round_}-{index}" if index == 0 else None
            _train_and_destroy(zero, save_dir)
            counts.append((_live_threads(), _live_groups()))
    # a new default group (the old one destroyed with every group) gets groups of its own
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{root}/second-store", rank=rank, world_size=world_size)
    loss = _train_and_destroy(ZERO_LAYOUTS[0], None)
    return {"counts": counts, "groups_after_rejoining": _live_groups(), "loss": loss}


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc (Linux)")
def test_destroyed_engines_leave_no_process_groups_or_threads_behind(tmp_path):
    results = run_distributed(_build_and_destroy_engines, 2, str(tmp_path), timeout=300)
    for result in results:
        counts = result["counts"]
        first_round, later = counts[: len(ZERO_LAYOUTS)], counts[len(ZERO_LAYOUTS):]
        # every layout's groups exist after the first round; later engines add none. Each
        # engine used to add 12 groups and 36 threads (3 gloo threads per group).
        groups_after_first_round = first_round[-1][1]
        assert [groups for _, groups in later] == [groups_after_first_round] * len(later), counts
        threads_after_first_round = first_round[-1][0]
        assert max(threads for threads, _ in later) <= threads_after_first_round + 4, counts
        # the second default group: one layout's groups built again on it, and training works
        assert 1 < result["groups_after_rejoining"] < groups_after_first_round, result
        assert torch.isfinite(torch.tensor(result["loss"]))


def test_groups_are_built_again_under_a_new_default_group(tmp_path):
    built = []

    def build() -> int:
        built.append(len(built))
        return built[-1]

    def join(name: str) -> None:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / name}", rank=0, world_size=1)

    join("first")
    try:
        assert shared_groups(("test", 1), build) == 0
        assert shared_groups(("test", 1), build) == 0  # the same key: not built again
        assert shared_groups(("test", 2), build) == 1
    finally:
        dist.destroy_process_group()
    join("second")
    try:
        assert shared_groups(("test", 1), build) == 2  # the first default group's are gone with it
    finally:
        dist.destroy_process_group()
