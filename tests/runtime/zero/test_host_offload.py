"""ZeRO-Offload's host tier (C11): the same training, bit for bit, with fp32 masters,
optimizer state and the gradient partition in host memory (and, at stage 3, the parameter
shards too); every byte counted in the tier the planner's formulas put it in."""

import pytest

from shardwise.formulas.memory import ADAM_FP32_STATES, Offload, optimizer_state_bytes, placed_model_state_bytes
from shardwise.tools.testing import run_distributed
from tests.runtime.zero.workers import Case, train_parallel

PARTITION_EVERYTHING = {"stage3_param_persistence_threshold": 0}


def case_for(stage: int, optimizer: str = "none", param: str = "none", dtype: str = "fp32",
             accumulation: int = 1) -> Case:
    zero = {"offload_optimizer": {"device": optimizer}, "offload_param": {"device": param},
            "sub_group_size": 2000}  # several optimizer sub-groups
    if stage == 3:
        zero.update(PARTITION_EVERYTHING)
    return Case(stage=stage, dtype=dtype, accumulation=accumulation, model="gpt-untied" if stage == 3 else "gpt",
                extra_config={"zero_optimization": zero})


@pytest.mark.parametrize(("stage", "param", "accumulation"), [
    (1, "none", 1), (2, "none", 2), (3, "none", 1), (3, "cpu", 2),
])
def test_offload_trains_exactly_like_no_offload(stage, param, accumulation):
    plain = run_distributed(train_parallel, 2, case_for(stage, accumulation=accumulation))
    offloaded = run_distributed(train_parallel, 2, case_for(stage, "cpu", param, accumulation=accumulation))
    for without, with_offload in zip(plain, offloaded):
        assert with_offload["losses"] == without["losses"]
        for name, tensor in without["params"].items():
            assert with_offload["params"][name].equal(tensor), name


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize(("stage", "param"), [(1, "none"), (2, "none"), (3, "none"), (3, "cpu")])
def test_bytes_live_in_the_tier_the_formulas_say(stage, param, dtype):
    world = 2
    result = run_distributed(train_parallel, world, case_for(stage, "cpu", param, dtype=dtype))[0]
    padded = result["numel"] + result["padding"]
    # K: Adam's moments (+ the fp32 master in 16-bit training); in fp32 the formula adds the
    # host's own master copy, which an offloaded optimizer needs beside the device weights
    expected = placed_model_state_bytes(padded, world, stage, Offload("cpu", param), dtype=dtype,
                                        optimizer_state_bytes_per_param=optimizer_state_bytes(ADAM_FP32_STATES, dtype))
    measured = result["memory_by_tier"]
    assert measured["device"]["params"] == expected["gpu"]["params"]
    assert measured["device"]["grads"] == expected["gpu"]["grads"]
    assert measured["device"]["optimizer_states"] == 0
    host = measured["host"]
    assert host["grads"] == expected["cpu"]["grads"]
    assert host["optimizer_states"] == expected["cpu"]["optimizer_states"]
    assert host["params"] == expected["cpu"]["params"]


def test_parameter_offload_alone_trains_exactly_like_no_offload():
    """DeepSpeed trains offload_param without offload_optimizer: the stage-3 shards live on the
    host between gathers while the masters and the step stay on the device."""
    plain = run_distributed(train_parallel, 2, case_for(3))
    offloaded = run_distributed(train_parallel, 2, case_for(3, "none", "cpu"))
    for without, with_offload in zip(plain, offloaded):
        assert with_offload["losses"] == without["losses"]
        for name, tensor in without["params"].items():
            assert with_offload["params"][name].equal(tensor), name
    assert offloaded[0]["memory_by_tier"]["host"]["params"] > 0
    assert offloaded[0]["memory_by_tier"]["host"]["optimizer_states"] == 0


def test_parameter_offload_alone_holds_the_formulas_tiers():
    world = 2
    result = run_distributed(train_parallel, world, case_for(3, "none", "cpu", dtype="bf16"))[0]
    padded = result["numel"] + result["padding"]
    expected = placed_model_state_bytes(padded, world, 3, Offload("none", "cpu"), dtype="bf16")
    measured = result["memory_by_tier"]
    assert measured["host"]["params"] == expected["cpu"]["params"]
    assert measured["device"]["params"] == expected["gpu"]["params"] == 0
    assert measured["device"]["grads"] == expected["gpu"]["grads"]
    assert measured["device"]["optimizer_states"] == expected["gpu"]["optimizer_states"]


@pytest.mark.parametrize(("stage", "param"), [(2, "none"), (3, "cpu")])
def test_sub_group_size_zero_steps_each_unit_piece_alone_and_trains_the_same(stage, param):
    """sub_group_size 0, as axolotl's ZeRO configs set it, is DeepSpeed's one parameter per
    sub-group: here each flat unit's piece is a sub-group of its own, uncut, and the
    training is the same as with sub-groups of 2000 elements."""
    sized = run_distributed(train_parallel, 2, case_for(stage, "cpu", param))
    zero_case = case_for(stage, "cpu", param)
    zero_case.extra_config["zero_optimization"]["sub_group_size"] = 0
    per_piece = run_distributed(train_parallel, 2, zero_case)
    for with_size, with_zero in zip(sized, per_piece):
        assert with_zero["losses"] == with_size["losses"]
        for name, tensor in with_size["params"].items():
            assert with_zero["params"][name].equal(tensor), name


def test_sub_group_size_zero_makes_each_segment_a_sub_group():
    from types import SimpleNamespace

    from shardwise.runtime.zero.shard_store import _split_sub_groups

    segments = [SimpleNamespace(numel=numel) for numel in (5000, 10, 300)]
    assert _split_sub_groups(segments, 0) == [[segment] for segment in segments]
    assert _split_sub_groups([], 0) == [[]]
    assert [len(group) for group in _split_sub_groups(segments, 10**9)] == [3]
