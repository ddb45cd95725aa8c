"""Partial optimizer offload (`offload_optimizer.ratio` < 1, ZeRO-Offload++ Twin-Flow): the
leading units' optimizer partition stays on the device, the trailing `ratio` of it is
offloaded; training is the same bit for bit, the bytes per tier are the formula's, and a
checkpoint moves between partial offload and none."""

import os
from functools import lru_cache

import pytest

from shardwise.runtime.zero.split_store import device_unit_count
from shardwise.formulas.memory import (
    ADAM_FP32_STATES, Offload, offloaded_partition_elements, optimizer_state_bytes, placed_partial_offload_bytes,
)
from shardwise.tools.testing import run_distributed
from tests.runtime.checkpoint.workers import Run, train_run
from tests.runtime.zero.workers import Case, train_parallel


def partial_case(stage: int, ratio: float | None, device: str = "cpu", dtype: str = "fp32", path=None,
                 steps: int = 3) -> Case:
    zero = {"sub_group_size": 2000}  # several sub-groups on each side of the split
    if ratio is not None:
        zero["offload_optimizer"] = {"device": device, "ratio": ratio, "nvme_path": str(path) if path else None}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    return Case(stage=stage, dtype=dtype, model="gpt-untied" if stage == 3 else "gpt", steps=steps,
                extra_config={"zero_optimization": zero})


def train_recording_units(rank: int, world_size: int, case: Case) -> dict:
    """`train_parallel`, plus each unit's per-rank partition (what the split is cut from)."""
    import tests.runtime.zero.workers as workers

    engines = []
    initialize = workers.shardwise.initialize

    def recording(*args, **kwargs):
        engines.append(initialize(*args, **kwargs))
        return engines[-1]

    workers.shardwise.initialize = recording  # this rank's own process
    result = train_parallel(rank, world_size, case)
    return {**result, "unit_partitions": [unit.chunk_numel for unit in engines[0].units]}


def test_the_split_is_the_unit_boundary_nearest_to_the_ratio():
    assert device_unit_count([100, 100, 100, 100], 0.5) == 2
    assert device_unit_count([100, 100, 100, 100], 0.3) == 3  # 280 kept: 300 is nearer than 200
    assert device_unit_count([100, 100, 100, 100], 0.375) == 2  # 250 kept: a tie offloads more
    assert device_unit_count([100, 100], 0.0) == 2 and device_unit_count([100, 100], 1.0) == 0
    for partitions in ([100, 100, 100, 100], [7, 300, 2, 51, 1000], [5]):
        for ratio in (0.0, 0.1, 0.3, 0.375, 0.5, 0.9, 1.0):
            kept = sum(partitions[: device_unit_count(partitions, ratio)])
            assert sum(partitions) - kept == offloaded_partition_elements(partitions, ratio)


@lru_cache(maxsize=None)
def without_offload(stage: int) -> list[dict]:
    return run_distributed(train_parallel, 2, partial_case(stage, None))


@pytest.mark.parametrize(("stage", "ratio"), [(1, 0.3), (2, 0.5), (3, 0.3)])
def test_partial_offload_trains_exactly_like_no_offload(stage, ratio):
    plain = without_offload(stage)
    partial = run_distributed(train_parallel, 2, partial_case(stage, ratio))
    for without, with_partial in zip(plain, partial):
        assert with_partial["losses"] == without["losses"]
        for name, tensor in without["params"].items():
            assert with_partial["params"][name].equal(tensor), name


def test_partial_nvme_offload_trains_exactly_like_no_offload(tmp_path):
    partial = run_distributed(train_parallel, 2, partial_case(2, 0.5, "nvme", path=tmp_path))
    for without, with_partial in zip(without_offload(2), partial):
        assert with_partial["losses"] == without["losses"]
        for name, tensor in without["params"].items():
            assert with_partial["params"][name].equal(tensor), name
    assert os.listdir(tmp_path) == []  # the swap files were private to the run


@pytest.mark.parametrize(("stage", "ratio", "dtype"), [(1, 0.5, "fp32"), (2, 0.3, "bf16"), (3, 0.5, "fp32")])
def test_bytes_per_tier_equal_the_formula(stage, ratio, dtype):
    world = 2
    result = run_distributed(train_recording_units, world, partial_case(stage, ratio, dtype=dtype, steps=1))[0]
    padded = result["numel"] + result["padding"]
    offloaded = offloaded_partition_elements(result["unit_partitions"], ratio)
    assert 0 < offloaded < padded // world  # both tiers hold part of it
    expected = placed_partial_offload_bytes(padded, world, stage, Offload("cpu"), offloaded, dtype=dtype,
                                            optimizer_state_bytes_per_param=optimizer_state_bytes(ADAM_FP32_STATES, dtype))
    measured = result["memory_by_tier"]
    for tier, device in (("device", "gpu"), ("host", "cpu")):
        for category in ("params", "grads", "optimizer_states"):
            assert measured[tier][category] == expected[device][category], (tier, category)


def test_a_checkpoint_saved_with_ratio_half_loads_without_offload(tmp_path):
    checkpoint = str(tmp_path / "checkpoint")
    uninterrupted = run_distributed(train_run, 2, Run(partial_case(2, None), steps=3))[0]
    run_distributed(train_run, 2, Run(partial_case(2, 0.5), steps=1, save_dir=checkpoint))
    resumed = run_distributed(train_run, 2, Run(partial_case(2, None), first_step=1, steps=2,
                                                load_dir=checkpoint))[0]
    assert resumed["losses"] == uninterrupted["losses"][1:]
    for name, tensor in uninterrupted["params"].items():
        assert resumed["params"][name].equal(tensor), name


def test_ratio_is_checked_in_the_config():
    from shardwise.frontends.deepspeed.config import ConfigError, load_config

    def load(offload_optimizer: dict, **zero):
        return load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
            "stage": 3, "offload_optimizer": offload_optimizer, **zero}}, world_size=1)

    assert load({"device": "cpu", "ratio": 0.3}).zero_optimization.offload_optimizer.ratio == 0.3
    with pytest.raises(ConfigError, match=r"offload_optimizer\.ratio"):
        load({"device": "cpu", "ratio": 1.5})
    with pytest.raises(ConfigError, match=r"ratio 0.5 with zero_optimization.offload_param.device 'cpu' is not "
                                          r"supported"):
        load({"device": "cpu", "ratio": 0.5}, offload_param={"device": "cpu"})
