"""An exception inside forward or backward, caught by the user, leaves the engine consistent
(reliability issue, item 2): the "skip a bad batch and continue" pattern trains exactly like
a run that never saw that batch, at every stage. Raised on some ranks only, it is an error
at the next step, never a silent mix of batches; in a tensor-parallel group, where the
peers wait for it inside that forward, at once on every rank."""

import pytest

from shardwise.tools.testing import DistributedTestError, run_distributed
from tests.faults.workers import Plan, compare, run_plan, run_plan_until_divergence
from tests.runtime.parallel.workers import parallel_case
from tests.runtime.zero.workers import Case


def case_for(stage: int, accumulation: int = 1) -> Case:
    return Case(stage=stage, accumulation=accumulation, model="gpt-untied" if stage == 3 else "gpt")


def assert_same_weights(faulty: dict, clean: dict) -> None:
    for name, tensor in faulty["params"].items():
        assert tensor.equal(clean["params"][name]), name


@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_skipped_bad_batch_trains_like_a_run_without_it(stage, where):
    faulty = Plan(case_for(stage), events={(1, 0): (where, None)})
    clean = Plan(case_for(stage), events={(1, 0): ("skip", None)})
    for with_fault, without in run_distributed(compare, 2, faulty, clean):
        assert with_fault["caught"] == 1
        assert with_fault["skipped_steps"] == 0
        assert_same_weights(with_fault, without)


@pytest.mark.parametrize("stage", [1, 3])
def test_an_exception_in_a_windows_first_micro_batch_is_as_if_it_never_happened(stage):
    faulty = Plan(case_for(stage, accumulation=2), events={(1, 0): ("backward", None)})
    clean = Plan(case_for(stage, accumulation=2), events={(1, 0): ("skip", None)})
    for with_fault, without in run_distributed(compare, 2, faulty, clean):
        assert_same_weights(with_fault, without)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_backward_raising_mid_window_drops_that_windows_update(stage):
    # micro-batch 0 of step 1 already accumulated; micro-batch 1 raises part-way through
    faulty = Plan(case_for(stage, accumulation=2), events={(1, 1): ("backward", None)})
    clean = Plan(case_for(stage, accumulation=2), events={(1, 0): ("skip", None), (1, 1): ("skip", None)})
    for with_fault, without in run_distributed(compare, 2, faulty, clean):
        assert with_fault["skipped_steps"] == 1
        assert_same_weights(with_fault, without)


@pytest.mark.parametrize("stage", [0, 2])
def test_an_exception_caught_on_one_rank_only_is_refused_at_the_step(stage):
    plan = Plan(case_for(stage), events={(1, 0): ("forward", [1])})
    with pytest.raises(DistributedTestError) as failure:
        run_distributed(run_plan, 2, plan)
    assert "a forward or backward raised on some ranks only (passes that raised: rank 0: 0, rank 1: 1)" in str(
        failure.value)


COLLECTIVE_TIMEOUT = 30  # seconds: the test fails, rather than hangs, if the error waits for it


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_an_exception_on_one_tensor_parallel_rank_is_named_on_every_rank_at_once(where):
    """TP=2: rank 1's forward (or backward) raises and rank 1 skips the batch; rank 0 waits
    in that pass's collectives. Both end with the error that names rank 1's exception,
    long before the collective timeout, and rank 0 never computes on rank 1's next batch."""
    plan = Plan(parallel_case(stage=1, tensor=2), events={(1, 0): (where, [1])})
    results = run_distributed(run_plan_until_divergence, 2, plan, timeout=3 * COLLECTIVE_TIMEOUT,
                              env={"SHARDWISE_COLLECTIVE_TIMEOUT": str(COLLECTIVE_TIMEOUT)})
    named = f"raised on some ranks only: rank 1 raised InjectedFault: injected in {where}"
    for rank, result in enumerate(results):
        assert result["error"] is not None, f"rank {rank} trained on"
        assert named in result["error"], result["error"]
        assert result["seconds"] < COLLECTIVE_TIMEOUT / 2, result
    assert "InjectedFault" in results[1]["cause"]  # the raising rank's own error is chained


def test_an_exception_on_every_tensor_parallel_rank_can_still_be_skipped():
    """Every rank of the group raises in the same pass: the batch is skipped, as with data
    parallelism, and training equals a run that never saw it."""
    faulty = Plan(parallel_case(stage=1, tensor=2), events={(1, 0): ("forward", None)})
    clean = Plan(parallel_case(stage=1, tensor=2), events={(1, 0): ("skip", None)})
    for with_fault, without in run_distributed(compare, 2, faulty, clean):
        assert with_fault["caught"] == 1
        assert_same_weights(with_fault, without)
