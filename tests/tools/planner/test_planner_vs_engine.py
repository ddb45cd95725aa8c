"""The planner's estimate for a real run agrees with the engine's own count (issue 5:
within 5%), for every stage, fp32 and bf16."""

import pytest

from shardwise.tools.planner import model_state_bytes
from shardwise.tools.testing import run_distributed
from tests.runtime.zero.workers import Case, train_parallel

PERSISTENCE = {"zero_optimization": {"stage3_param_persistence_threshold": 100}}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_estimate_matches_memory_breakdown_within_five_percent(stage, dtype):
    world = 2
    case = Case(stage=stage, dtype=dtype, steps=1, extra_config=PERSISTENCE if stage == 3 else {})
    result = run_distributed(train_parallel, world, case)[0]
    persistent = result.get("persistent_padded", 0)
    estimate = model_state_bytes(result["numel"], world, stage, dtype, persistent_params=persistent)
    for category, estimated in estimate.items():
        measured = result["memory"][category]
        assert abs(measured - estimated) <= 0.05 * measured, (category, measured, estimated)
