"""NCCL's call paths on one GPU: with SHARDWISE_COLLECTIVES_AT_WORLD_SIZE_1=1 a group of one
issues every data collective as a real NCCL call (distributed/collectives.py), on CUDA
tensors: all-reduce, reduce-scatter and all-gather in place (output aliasing input) and
into other buffers, all-gather into pieces, all-to-all, broadcast, each through its async
handle and `wait()`. Calls are counted by wrapping torch.distributed's functions in the
rank (tests/runtime/distributed/workers.py), which still run them.

The engine-level runs of every other tests/gpu module issue theirs the same way
(`run_ranks` fails a run that issued none). The engine's all-to-all (1-bit Adam's
compressed exchange, Ulysses) exists only between two or more workers: one worker's
momentum is not compressed, so on one GPU the all-to-all is checked here alone.
"""

import pytest

from shardwise.runtime.distributed.collectives import COLLECTIVES_AT_SIZE_ONE_VARIABLE
from shardwise.tools.testing import run_distributed
from tests.runtime.distributed.workers import exercise_group_of_one
from tests.gpu.target import BACKEND, DEVICE, REHEARSAL, WORLD, needs_target, run_ranks
from tests.runtime.optim.onebit_reference import OneBitSettings, Simulation
from tests.runtime.optim.test_onebit import STEPS, assert_equal_to, train_engine, whole_state

pytestmark = needs_target


def test_every_data_collective_of_a_group_of_one_is_a_real_call():
    """A world of one whatever the machine has (a group of one is what the switch is for)."""
    env = {COLLECTIVES_AT_SIZE_ONE_VARIABLE: "1", **({"CUDA_VISIBLE_DEVICES": ""} if REHEARSAL else {})}
    (result,) = run_distributed(exercise_group_of_one, 1, DEVICE, backend=BACKEND, env=env)
    assert result["issues"] and result["asynchronous"]
    assert result["counts"] == {"all_reduce": 1, "reduce_scatter": 2, "all_gather": 3, "all_to_all": 1,
                                "broadcast": 1}
    for name, tensor in result["results"].items():  # a sum over one rank, and every gather, is the input
        assert tensor.tolist() == list(range(8)), name
    assert result["volume"] == {}  # a ring over one rank sends nothing


@pytest.mark.skipif(WORLD < 2, reason="1-bit Adam compresses only between 2 or more workers: needs 2 GPUs")
def test_onebit_adams_compressed_exchange_runs_its_all_to_all():
    """1-bit Adam at stage 0: 2 warm-up steps, then 3 compressed (all-to-all of signs and
    scales, all-gather of the server's), equal to the simulation of the algorithm."""
    settings = OneBitSettings("adam", weight_decay=0.01, clipping=0.05)
    runs = run_ranks(train_engine, settings, collectives=True)
    results = [result for result, _ in runs]
    simulation = Simulation(settings, WORLD, results[0]["order"], results[0]["units"])
    losses = simulation.train(range(settings.freeze_step))
    # the warm-up agrees to rounding; the compressed phase starts from the engine's state
    simulation.adopt(whole_state(results, "at_freeze"), tolerance=1e-5)
    losses += simulation.train(range(settings.freeze_step, STEPS))
    for result, issued in runs:
        assert_equal_to(result, losses, simulation.weights())
        assert issued.get("all_to_all", 0) >= STEPS - settings.freeze_step, issued
