"""Non-finite gradients never reach a weight, in any precision (reliability issue, item 1).

A NaN loss on one rank makes the global gradient norm NaN on every rank; the step is then
skipped everywhere, counted, and the run continues exactly as if that step had never been
taken. Too many in a row stop the run with an error that names the ranks.
"""

import pytest

from shardwise.tools.testing import DistributedTestError, run_distributed
from tests.faults.workers import Plan, compare, run_plan
from tests.runtime.zero.workers import Case


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_nan_loss_on_one_rank_skips_the_step_on_every_rank(stage, dtype):
    case = Case(stage=stage, dtype=dtype, lr=1e-3, model="gpt-untied" if stage == 3 else "gpt")
    faulty = Plan(case, events={(1, 0): ("nan", [1])})
    clean = Plan(case, events={(1, 0): ("skip", None)})  # never sees batch 1
    for with_nan, without in run_distributed(compare, 2, faulty, clean):
        assert with_nan["skipped_steps"] == with_nan["nonfinite_steps"] == 1
        assert with_nan["global_steps"] == 4 and without["global_steps"] == 3
        for name, tensor in with_nan["params"].items():
            assert tensor.isfinite().all(), name
            assert tensor.equal(without["params"][name]), name


def test_too_many_nonfinite_steps_in_a_row_stop_the_run():
    case = Case(stage=2, extra_config={"max_consecutive_skipped_steps": 2})
    plan = Plan(case, steps=5, events={(step, 0): ("nan", [1]) for step in range(1, 5)})
    with pytest.raises(DistributedTestError) as failure:
        run_distributed(run_plan, 2, plan)
    message = str(failure.value)
    assert ("NonFiniteGradientError: optimizer step 3 is the 3th in a row with a non-finite gradient norm "
            "(the loss was not finite on rank(s) 1); stopping instead of training on.") in message


def test_fp16_loss_scaling_overflows_do_not_count_until_the_scale_is_at_its_minimum():
    # the scale starts at 2^40: every step overflows until the scale has come down; those
    # skips are the loss scaler's normal calibration, not a failing run
    case = Case(stage=2, dtype="fp16", lr=1e-3,
                extra_config={"fp16": {"initial_scale_power": 40, "hysteresis": 1}, "max_consecutive_skipped_steps": 0})
    result = run_distributed(run_plan, 2, Plan(case, steps=4))[0]
    assert result["skipped_steps"] >= 2
    assert all(tensor.isfinite().all() for tensor in result["params"].values())
