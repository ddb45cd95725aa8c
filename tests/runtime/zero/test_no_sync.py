"""`engine.no_sync()` (DDP's and DeepSpeed's): the gradient-synchronisation strategy's
local mode. Backward passes inside accumulate on each rank without communicating; the
first backward after the block reduces everything, once."""

import pytest
import torch

import shardwise
from shardwise.tools.testing import run_distributed
from tests.runtime.zero.workers import (
    Case, build_model, global_batch, make_optimizer, model_loss, relative_error, train_reference,
)


def accumulate_with_no_sync(rank: int, world_size: int, stage: int, micro_batches: int,
                            backward: str = "engine") -> dict:
    """One optimizer step over `micro_batches` micro-batches, all but the last inside no_sync;
    `backward` "script": each backward started by `loss.backward()` on the engine's output
    (runtime/engine/output_backward.py) instead of engine.backward."""
    case = Case(stage=stage, micro_batch=2)
    model = build_model(case.model)
    engine = shardwise.initialize(model, case.config(world_size), optimizer=make_optimizer(model, case.lr))
    rows = world_size * micro_batches * case.micro_batch
    x, y = global_batch(0, rows)
    engine.reset_comm_volume()
    for micro in range(micro_batches):
        start = (micro * world_size + rank) * case.micro_batch
        loss = model_loss(engine, case.model, x[start:start + 2], y[start:start + 2]) / micro_batches
        run_backward = loss.backward if backward == "script" else lambda: engine.backward(loss)
        if micro < micro_batches - 1:
            with engine.no_sync():
                run_backward()
        else:
            run_backward()
            engine.step()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"params": params, "comm": engine.comm_volume()}


@pytest.mark.parametrize("backward", ["engine", "script"])
@pytest.mark.parametrize("stage", [0, 1])
def test_no_sync_accumulates_locally_and_reduces_once(stage, backward):
    micro_batches = 3
    results = run_distributed(accumulate_with_no_sync, 2, stage, micro_batches, backward)
    # the same update as one process accumulating the same micro-batches rank by rank
    case = Case(steps=1, accumulation=micro_batches, micro_batch=2)
    expected = train_reference(case, 2, per_micro_batch=True)["params"]
    for result in results:
        for name, want in expected.items():
            assert relative_error(result["params"][name], want) < 1e-5, name
    # communication of one reduction, not three
    single = run_distributed(accumulate_with_no_sync, 2, stage, 1)[0]["comm"]
    assert results[0]["comm"] == single


def test_no_sync_is_refused_where_gradients_are_partitioned():
    model = build_model("gpt")
    engine = shardwise.initialize(model, {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}},
                                  optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match="engine.no_sync\\(\\) needs ZeRO stage 0 or 1: stage 2"):
        with engine.no_sync():
            pass


def test_step_inside_no_sync_is_refused():
    model = build_model("gpt")
    engine = shardwise.initialize(model, {"train_micro_batch_size_per_gpu": 2},
                                  optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = global_batch(0, 2)
    with engine.no_sync():
        engine.backward(engine(x, y))
        with pytest.raises(RuntimeError, match="engine.step\\(\\) inside engine.no_sync\\(\\)"):
            engine.step()
