"""Stage 3 trains exactly like one process, and like stage 0 (docs/development.md#how-shardwise-is-tested, issue: ZeRO-3)."""

from functools import lru_cache

import pytest

from shardwise.tools.testing import run_distributed
from tests.runtime.zero.workers import Case, assert_matches_reference, train_parallel, train_reference

TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2}
LR = {"fp32": 1e-2, "bf16": 1e-3}
PARTITION_EVERYTHING = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}
KEEP_SMALL_WHOLE = {"zero_optimization": {"stage3_param_persistence_threshold": 100}}


@lru_cache(maxsize=None)
def reference(accumulation: int, world_size: int, lr: float, model: str = "gpt") -> dict:
    return train_reference(Case(accumulation=accumulation, lr=lr, model=model), world_size)


@pytest.mark.parametrize("persistence", ["none", "small"])
@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_matches_single_process_reference(dtype, world_size, accumulation, persistence):
    extra = PARTITION_EVERYTHING if persistence == "none" else KEEP_SMALL_WHOLE
    case = Case(stage=3, dtype=dtype, accumulation=accumulation, lr=LR[dtype], extra_config=extra)
    results = run_distributed(train_parallel, world_size, case)
    expected = reference(accumulation, world_size, LR[dtype])
    for result in results:
        assert_matches_reference(result, expected, TOLERANCE[dtype])


def test_stage3_equals_stage0():
    stage0 = run_distributed(train_parallel, 2, Case(stage=0))[0]
    stage3 = run_distributed(train_parallel, 2, Case(stage=3, extra_config=PARTITION_EVERYTHING))[0]
    assert stage3["losses"] == pytest.approx(stage0["losses"], rel=1e-6)
    for name, tensor in stage0["params"].items():
        error = ((stage3["params"][name] - tensor).norm() / tensor.norm()).item()
        assert error < 1e-6, (name, error)
