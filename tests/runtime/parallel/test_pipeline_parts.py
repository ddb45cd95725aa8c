"""The pipeline's pieces without processes: every schedule finishes when receives block
(no deadlock), its idle share equals the bubble formula exactly at unit costs, its peak of
micro-batches in flight equals the memory formula; layer partitioning; config checks."""

import pytest

from shardwise.frontends.deepspeed.config import load_config
from shardwise.runtime.parallel.pipeline import schedule_actions, simulate
from shardwise.runtime.parallel.pipeline.split import partition
from shardwise.formulas.communication import PipelineCommShape, pipeline_p2p_bytes, pipeline_p2p_total_bytes
from shardwise.formulas.layers import pipeline_bubble_fraction, pipeline_micro_batches_in_flight

CASES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3)]


@pytest.mark.parametrize("schedule,virtual", CASES)
@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_simulated_bubble_equals_the_formula(schedule, virtual, size, groups):
    """Forward 1, backward 2 per stage (each chunk 1/v of that): the idle share of every rank
    is (p-1)/(m+p-1), or (p-1)/(v*m+p-1) interleaved."""
    m = groups * size
    timing = simulate(schedule, size, m, virtual, forward_cost=1 / virtual, backward_cost=2 / virtual)
    makespan = max(timing["finish"])
    for busy in timing["busy"]:
        assert 1 - busy / makespan == pytest.approx(pipeline_bubble_fraction(size, m, virtual), abs=1e-12)


@pytest.mark.parametrize("schedule,virtual", CASES)
@pytest.mark.parametrize("size,m", [(2, 4), (3, 6), (4, 8), (4, 4), (2, 8)])
def test_micro_batches_in_flight_equal_the_formula(schedule, virtual, size, m):
    for rank in range(size):
        held, peak = set(), 0
        for action in schedule_actions(schedule, rank, size, m, virtual):
            key = (action.chunk, action.micro_batch)
            if action.kind == "forward":
                held.add(key)
                peak = max(peak, len(held))
            else:
                held.remove(key)
        assert not held
        assert peak == pipeline_micro_batches_in_flight(schedule, size, m, rank, virtual)


def test_1f1b_holds_p_micro_batches_where_gpipe_holds_m():
    assert pipeline_micro_batches_in_flight("gpipe", 4, 16) == 16
    assert pipeline_micro_batches_in_flight("1f1b", 4, 16) == 4
    assert pipeline_micro_batches_in_flight("1f1b", 4, 2) == 2


def test_every_micro_batch_runs_forward_then_backward_once_per_chunk():
    for schedule, virtual in CASES:
        actions = schedule_actions(schedule, 1, 2, 4, virtual)
        forwards = [(a.chunk, a.micro_batch) for a in actions if a.kind == "forward"]
        backwards = [(a.chunk, a.micro_batch) for a in actions if a.kind == "backward"]
        assert sorted(forwards) == sorted(backwards) == sorted((c, i) for c in range(virtual) for i in range(4))
        for chunk in range(virtual):  # ZeRO accumulates each chunk's micro-batches in order
            assert [i for c, i in backwards if c == chunk] == list(range(4))


def test_interleaved_needs_micro_batches_divisible_by_stages():
    with pytest.raises(ValueError, match="divisible by the pipeline size"):
        schedule_actions("interleaved", 0, 2, 3, 2)


def test_p2p_formula_totals():
    shape = PipelineCommShape(micro_batch=2, seq_len=16, hidden=32, activation_bytes=4, size=4, micro_batches=8,
                              virtual=2, tied_weight_bytes=1000)
    x = 2 * 16 * 32 * 4
    assert pipeline_p2p_total_bytes(shape) == 2 * 8 * x * (4 * 2 - 1) + 2 * 1000
    assert pipeline_p2p_bytes(shape, 1) == 2 * 8 * x * 2  # a middle rank: both directions, every chunk


def test_partition_balances_parameters_and_honours_rules():
    assert partition([1, 1, 1, 1], 2) == [[0, 1], [2, 3]]
    # a heavy embedding on the first stage pushes layers to the last
    assert partition([10] * 6, 2, first_extra=40) == [[0], [1, 2, 3, 4, 5]]
    assert partition([1] * 6, 3, rule="uniform") == [[0, 1], [2, 3], [4, 5]]
    assert partition([1] * 5, 2, split_points=[1]) == [[0], [1, 2, 3, 4]]
    with pytest.raises(ValueError, match="partition 'uniform'"):
        partition([1] * 5, 2, rule="uniform")
    with pytest.raises(ValueError, match="split_points"):
        partition([1] * 5, 2, split_points=[7])
    with pytest.raises(ValueError, match="fewer than the 4 stages"):
        partition([1] * 3, 4)


def _config(**pipeline) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4,
            "pipeline_parallel": {"size": 2, **pipeline}}


@pytest.mark.parametrize("pipeline,extra,message", [
    ({"schedule": "interleaved"}, {}, "virtual_stages >= 2"),
    ({"virtual_stages": 2}, {}, "needs pipeline_parallel.schedule 'interleaved'"),
    ({"split_points": [1, 2]}, {}, "split_points has 2 entries"),
    ({}, {"zero_optimization": {"stage": 3}}, "zero_optimization.stage 3 with pipeline_parallel.size 2"),
    ({"schedule": "interleaved", "virtual_stages": 2}, {"gradient_accumulation_steps": 3}, "not a multiple"),
    ({}, {"sequence_parallel": {"size": 2}}, "sequence parallelism with pipeline_parallel.size 2"),
])
def test_contradictions_are_named(pipeline, extra, message):
    config = {**_config(**pipeline), **extra}
    world = 4 if "sequence_parallel" in extra else 2
    with pytest.raises(ValueError, match=message):
        load_config(config, world_size=world)


def test_a_valid_pipeline_config_loads():
    config = load_config(_config(schedule="interleaved", virtual_stages=2), world_size=4)
    assert config.pipeline_parallel.micro_batches == 4
