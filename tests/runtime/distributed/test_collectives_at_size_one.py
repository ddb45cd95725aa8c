"""The test-only switch SHARDWISE_COLLECTIVES_AT_WORLD_SIZE_1 (distributed/collectives.py):
with it, a group of one issues the real torch.distributed call of every data collective,
which is how tests/gpu runs the NCCL call paths on one GPU. Checked here on gloo: the calls
are made (counted by wrapping torch.distributed's collective functions in the rank, which
still run them), their results are what skipping gives, and training is unchanged, bit for
bit, accounting included."""

from shardwise.runtime.distributed.collectives import COLLECTIVES_AT_SIZE_ONE_VARIABLE, Communicator
from shardwise.runtime.distributed.mesh import GroupHandle
from shardwise.tools.testing import run_distributed
from tests.runtime.distributed.workers import exercise_group_of_one, train_counting_collectives
from tests.runtime.zero.workers import Case

SWITCH = {COLLECTIVES_AT_SIZE_ONE_VARIABLE: "1"}


def test_a_group_of_one_issues_every_data_collective_under_the_switch():
    (issued,) = run_distributed(exercise_group_of_one, 1, env=SWITCH)
    (skipped,) = run_distributed(exercise_group_of_one, 1)
    assert issued["issues"] and not skipped["issues"]
    assert issued["asynchronous"] and not skipped["asynchronous"]
    # two reduce-scatters (one in place), three all-gathers (in place, into a buffer, into pieces)
    assert issued["counts"] == {"all_reduce": 1, "reduce_scatter": 2, "all_gather": 3, "all_to_all": 1,
                                "broadcast": 1}
    assert skipped["counts"] == {}
    expected = list(range(8))
    for name, tensor in issued["results"].items():
        assert tensor.tolist() == expected, name
        assert skipped["results"][name].tolist() == expected, name
    assert issued["volume"] == skipped["volume"] == {}  # a ring over one rank sends nothing


def test_training_at_world_size_one_is_unchanged_by_the_switch():
    stage3 = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}
    cases = [Case(stage=0), Case(stage=1, accumulation=2), Case(stage=2), Case(stage=3, extra_config=stage3)]
    (issued,) = run_distributed(train_counting_collectives, 1, cases, env=SWITCH)
    (skipped,) = run_distributed(train_counting_collectives, 1, cases)
    for case, with_calls, without in zip(cases, issued, skipped):
        assert with_calls["losses"] == without["losses"], case.stage
        for name, tensor in without["params"].items():
            assert with_calls["params"][name].equal(tensor), (case.stage, name)
        assert with_calls["comm"] == without["comm"] and with_calls["comm_by_group"] == without["comm_by_group"]
        assert without["collectives"] == {}
    calls = [run["collectives"] for run in issued]
    for stage, made in enumerate(calls):
        assert made["broadcast"] > 0, stage  # the initial weights from the first replica
        # gradients: summed over the shard group (a reduce-scatter) and over the replicas
        assert made["reduce_scatter"] > 0 and made["all_reduce"] > 0, stage
    for stage in (1, 2, 3):  # the updated partitions (1-2) or every unit before its use (3) gathered
        assert calls[stage]["all_gather"] > 0, stage


def test_without_a_process_group_the_switch_has_nothing_to_issue_on(monkeypatch):
    """A plain single process (no process group) skips as before, switch or not."""
    monkeypatch.setenv(COLLECTIVES_AT_SIZE_ONE_VARIABLE, "1")
    comm = Communicator(GroupHandle("shard", (0,), 0, None, None))
    assert comm.skips_collectives
    assert comm.all_reduce(__import__("torch").ones(2), "a tensor").work is None
