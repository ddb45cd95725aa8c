"""memory_breakdown() and comm_volume() equal the ZeRO formulas of docs/formulas.md#model-states-per-rank
and docs/formulas.md#communication-per-step.

Counts use the padded element count Ψ' the engine really holds; Ψ' - Ψ is bounded by
the alignment padding (units × N × alignment elements), which is asserted too.
"""

import pytest

from shardwise.tools.testing import run_distributed
from shardwise.runtime.zero.gradients import MAX_IN_FLIGHT
from shardwise.runtime.zero.layout import align_elements
from shardwise.runtime.reliability.step_guard import FIELDS as STEP_CHECK_FIELDS
from tests.runtime.zero.workers import Case, train_parallel

BYTES = {"fp32": 4, "bf16": 2}
K = {"fp32": 8, "bf16": 12}  # fp32: momentum + variance; bf16: + fp32 master copy


def expected_memory(stage: int, dtype: str, padded: int, world: int) -> dict:
    b, k = BYTES[dtype], K[dtype]
    shard = padded // world if stage > 0 else padded
    return {
        "params": b * padded,
        "grads": b * padded if stage <= 1 else b * shard,
        "optimizer_states": k * shard,
    }


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("world_size", [2, 4])
def test_memory_breakdown_matches_zero_formula(stage, dtype, world_size):
    case = Case(stage=stage, dtype=dtype, steps=1)
    result = run_distributed(train_parallel, world_size, case)[0]
    padded = result["numel"] + result["padding"]
    chunks = 1 if stage == 0 else world_size
    assert result["padding"] < result["units"] * chunks * align_elements_for(dtype)
    memory = result["memory"]
    for category, value in expected_memory(stage, dtype, padded, world_size).items():
        assert memory[category] == value, (category, memory[category], value)
    # Transient buffers, a constant number of units (Cb): gradient buckets (stage 2), the
    # receive buffers of reduce-scatters in flight (stages 1-2), plus, in bf16, the fp32
    # gradient copy of one optimizer sub-group (here the whole shard).
    unit_bytes = result["largest_unit"] * BYTES[dtype]
    buckets = (MAX_IN_FLIGHT + 1) * unit_bytes if stage == 2 else 0
    receive = MAX_IN_FLIGHT * unit_bytes * (world_size - 1) // world_size if stage > 0 else 0
    fp32_grads = 4 * padded // chunks if dtype == "bf16" else 0
    assert memory["buffers"] <= buckets + receive + fp32_grads
    if stage == 2:
        assert memory["buffers"] > fp32_grads  # the buckets are counted


def align_elements_for(dtype: str) -> int:
    import torch

    return align_elements({"fp32": torch.float32, "bf16": torch.bfloat16}[dtype])


@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_comm_volume_matches_zero_formula(stage, dtype, accumulation):
    world = 2
    case = Case(stage=stage, dtype=dtype, steps=1, accumulation=accumulation)
    result = run_distributed(train_parallel, world, case)[0]
    padded = result["numel"] + result["padding"]
    b = BYTES[dtype]
    share = padded * b * (world - 1) // world
    comm = result["comm"]
    if stage == 0:
        assert comm["all_reduce"] == 2 * share  # once per step, accumulation is local
        assert comm["reduce_scatter"] == comm["all_gather"] == 0
    else:
        scatters = accumulation if stage == 2 else 1  # stage 2 holds only a shard
        assert comm["reduce_scatter"] == scatters * share
        assert comm["all_gather"] == share
        assert comm["all_reduce"] == 0
    # the step check (reliability/step_guard.py): the norm, and per rank its fields and the
    # learning rate of each param group (at most 2 here); not data
    assert comm["control"] <= 8 * (1 + world * (STEP_CHECK_FIELDS + 2))


def stage3_case(dtype: str, threshold: int, **zero) -> Case:
    extra = {"zero_optimization": {"stage3_param_persistence_threshold": threshold, **zero}}
    return Case(stage=3, dtype=dtype, steps=2, model="gpt-untied", extra_config=extra)


@pytest.mark.parametrize("threshold", [0, 100])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_stage3_memory_is_one_nth_plus_persistent_parameters(dtype, threshold):
    world = 2
    result = run_distributed(train_parallel, world, stage3_case(dtype, threshold))[0]
    b, k = BYTES[dtype], K[dtype]
    partitioned, persistent = result["partitioned_padded"], result["persistent_padded"]
    assert (persistent > 0) == (threshold > 0)
    shard = (partitioned + persistent) // world
    memory = result["memory"]
    assert memory["params"] == b * (partitioned // world + persistent)
    assert memory["grads"] == b * shard
    assert memory["optimizer_states"] == k * shard


@pytest.mark.parametrize("threshold", [0, 100])
def test_stage3_comm_volume_is_three_gathers_less_persistent(threshold):
    world = 2
    case = stage3_case("fp32", threshold, stage3_max_reuse_distance=0)
    result = run_distributed(train_parallel, world, case)[0]
    partitioned, persistent = result["partitioned_padded"], result["persistent_padded"]

    def share(numel: int) -> int:
        return numel * 4 * (world - 1) // world

    comm = result["comm"]  # measured over the whole run: 2 steps
    # partitioned: gathered in forward and again in backward, reduce-scattered once;
    # persistent: reduce-scattered, and their updated chunks all-gathered after the step
    assert comm["all_gather"] == 2 * (2 * share(partitioned) + share(persistent))
    assert comm["reduce_scatter"] == 2 * (share(partitioned) + share(persistent))
    assert comm["all_reduce"] == 0


def test_stage3_gathered_parameters_stay_within_live_limit():
    world = 2
    probe = run_distributed(train_parallel, world, stage3_case("fp32", 0))[0]
    limit = 2 * probe["largest_unit"]
    case = stage3_case(
        "fp32", 0, stage3_max_live_parameters=limit, stage3_prefetch_bucket_size=limit,
        stage3_max_reuse_distance=0,
    )
    result = run_distributed(train_parallel, world, case)[0]
    assert 0 < result["peak_gathered"] <= limit
    assert probe["peak_gathered"] > limit, "the default limits should gather more at once"
