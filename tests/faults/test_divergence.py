"""Ranks that agreed at start-up but then run different work (reliability issue 30, item 1):
each is named at the next step check, on every rank, never trained on silently and never
left to the collective timeout."""

import pytest

from shardwise.tools.testing import DistributedTestError, run_distributed
from tests.faults.divergent_ranks import (edit_weights_on_one_rank, evaluate_on_one_rank, gather_on_one_rank, rank_dependent_schedule,
                                          several_backwards_per_step, skip_a_step)


def failure_of(fn, *args) -> str:
    """The first rank's error (the harness stops the others): every rank raises the same
    one, since each decides from the same exchanged values."""
    with pytest.raises(DistributedTestError) as failure:
        run_distributed(fn, 2, *args, timeout=60)
    message = str(failure.value)
    assert "Timed out" not in message and "CollectiveError" not in message, message
    return message


@pytest.mark.parametrize("stage", [0, 2])
def test_a_learning_rate_that_differs_per_rank_is_refused(stage):
    message = failure_of(rank_dependent_schedule, stage)
    expected = ("at optimizer step 1 the ranks would apply different learning rates to param group 0 "
                "(rank 0: 0.01, rank 1: 0.02)")
    assert expected in message, message


@pytest.mark.parametrize("stage", [0, 2])
def test_a_rank_that_skips_step_is_named(stage):
    message = failure_of(skip_a_step, stage)
    expected = "rank 1 began a new backward without calling step() after its last backward, while rank(s) 0"
    assert expected in message, message


def test_a_rank_that_skips_step_at_stage_3_is_named_at_its_next_forward():
    message = failure_of(skip_a_step, 3)
    assert "rank 1 began a new forward without calling step()" in message, message


@pytest.mark.parametrize("stage", [0, 3])
def test_several_backwards_before_one_step_on_every_rank_still_train(stage):
    first, second = run_distributed(several_backwards_per_step, 2, stage, timeout=60)
    assert first == second


def test_weights_edited_on_one_rank_are_named_by_the_replica_check():
    # stage 0: each rank updates its own copy (stages 1-2 rebuild the weights from the
    # partitioned masters after every update, which overwrites such an edit on every rank)
    message = failure_of(edit_weights_on_one_rank, 0, 2, True, None)
    expected = ("the replica check after optimizer step 2 found that the data-parallel replicas no longer hold the "
                "same weights: parameter blocks.1.mlp.fc.weight on rank(s) 1 differs from rank 0's")
    assert expected in message, message


def test_the_replica_check_runs_before_a_save(tmp_path):
    message = failure_of(edit_weights_on_one_rank, 0, 100, True, str(tmp_path))
    assert "the replica check before saving a checkpoint found" in message, message
    assert not any(tmp_path.iterdir())  # nothing was written


def test_identical_replicas_pass_the_replica_check(tmp_path):
    assert run_distributed(edit_weights_on_one_rank, 2, 0, 1, False, str(tmp_path), timeout=60) == [3, 3]


def test_gathered_parameters_entered_on_one_rank_at_stage_3_is_named():
    # rank 0 is at its next forward, whose check meets rank 1's: both name each other at once
    message = failure_of(gather_on_one_rank)
    assert ("ranks disagree on which parameters to gather (rank 0 began a training forward; rank 1 entered "
            "gathered_parameters)") in message, message


def test_an_extra_evaluation_forward_on_one_rank_at_stage_3_is_named_at_once():
    message = failure_of(evaluate_on_one_rank)
    assert ("ranks disagree on which parameters to gather (rank 0 began a training forward; rank 1 began a no-grad "
            "forward)") in message, message
