"""Ranks agree before they train (reliability issue, item 3): a rank whose model, config or
optimizer differs is named at `initialize`, before any data collective could pair wrong
tensors, abort the process inside gloo or wait out the timeout."""

import pytest

from shardwise.tools.testing import DistributedTestError, run_distributed
from tests.faults.workers import initialize_differently

CASES = {
    "order": "ranks disagree on the model before training: line 1 is 'parameter layers.a.weight (8, 8) "
             "torch.float32 trainable in param group 0' on rank 0 but 'parameter layers.b.weight (8, 8) "
             "torch.float32 trainable in param group 0' on rank 1",
    "width": "ranks disagree on the model before training: line 1 is 'parameter layers.a.weight (8, 8) "
             "torch.float32 trainable in param group 0' on rank 0 but 'parameter layers.a.weight (16, 16) "
             "torch.float32 trainable in param group 0' on rank 1",
    "stage": "ranks disagree on the config before training: line",
    "bucket": "'zero_optimization.reduce_bucket_size = 100' on rank 0 but "
              "'zero_optimization.reduce_bucket_size = 200' on rank 1",
    "lr": "'optimizer param group 0 lr = 0.1' on rank 0 but 'optimizer param group 0 lr = 0.2' on rank 1",
}


@pytest.mark.parametrize("what", sorted(CASES))
def test_a_rank_set_up_differently_is_named_at_initialize(what):
    with pytest.raises(DistributedTestError) as failure:
        run_distributed(initialize_differently, 2, what, timeout=60)
    message = str(failure.value)
    assert "RankMismatchError" in message and CASES[what] in message, message
    # Named by the agreement itself, not by a rank that waited out the collective timeout (a
    # wall-clock bound would measure the machine's load, not this).
    assert "CollectiveError" not in message and "Timed out" not in message, message


def test_the_stage_difference_is_named_by_key():
    with pytest.raises(DistributedTestError) as failure:
        run_distributed(initialize_differently, 2, "stage", timeout=60)
    assert "'zero_optimization.stage = 2' on rank 0 but 'zero_optimization.stage = 1' on rank 1" in str(failure.value)


def test_identical_ranks_pass():
    assert run_distributed(initialize_differently, 2, "nothing") == ["ok", "ok"]
