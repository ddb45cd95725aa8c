"""Hybrid sharding (`zero_optimization.mics_shard_size`, C25): model states sharded within
groups of that size and replicated across groups; gradients reduce-scattered inside a
group and all-reduced across groups; parameters gathered only inside a group.

World 4 with shard groups of 2, stages 1-3: the same result as one process (docs/development.md#how-shardwise-is-tested), the
memory of plain ZeRO with N = 2, and the communication of the two-level formula
(shardwise/formulas/communication.py), per group and to the byte.
"""

from functools import lru_cache

import pytest

from shardwise.formulas.communication import CommShape, comm_bytes_by_group
from shardwise.formulas.memory import model_state_bytes
from shardwise.tools.testing import run_distributed
from tests.runtime.zero.workers import Case, assert_matches_reference, train_parallel, train_reference

WORLD, SHARD = 4, 2


def hybrid_case(stage: int, accumulation: int = 1, steps: int = 3) -> Case:
    zero = {"mics_shard_size": SHARD}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0, stage3_max_reuse_distance=0)
    model = "gpt-untied" if stage == 3 else "gpt"
    return Case(stage=stage, accumulation=accumulation, steps=steps, model=model,
                extra_config={"zero_optimization": zero})


@lru_cache(maxsize=None)
def reference(accumulation: int, model: str) -> dict:
    return train_reference(Case(accumulation=accumulation, model=model), WORLD)


@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_hybrid_sharding_matches_single_process(stage, accumulation):
    case = hybrid_case(stage, accumulation)
    results = run_distributed(train_parallel, WORLD, case)
    for result in results:
        assert_matches_reference(result, reference(accumulation, case.model), 1e-5)
    for name, tensor in results[0]["params"].items():
        for other in results[1:]:
            assert other["params"][name].equal(tensor), name


@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_hybrid_memory_and_communication_follow_the_formulas(stage, accumulation):
    result = run_distributed(train_parallel, WORLD, hybrid_case(stage, accumulation, steps=1))[0]
    padded = result["numel"] + result["padding"]
    memory = model_state_bytes(padded, SHARD, stage, "fp32")
    for category, value in memory.items():
        assert result["memory"][category] == value, category
    shape = CommShape(padded, stage, SHARD, WORLD // SHARD, grad_bytes=4, param_bytes=4,
                      accumulation_steps=accumulation)
    expected = comm_bytes_by_group(shape)
    measured = result["comm_by_group"]
    for group in ("shard", "replicate"):
        got = {op: measured.get(group, {}).get(op, 0) for op in expected[group]}
        assert got == expected[group], (group, got, expected[group])
    # the replicas all-reduce moves a 1/S slice: half the bytes of a full all-reduce over N = 4
    assert expected["replicate"]["all_reduce"] == 2 * (padded // SHARD) * 4 // 2
