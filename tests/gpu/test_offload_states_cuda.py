"""`engine.offload_states()` / `reload_states()` on CUDA (zero/parked_states.py): the
device memory the moved states held is given back to the allocator, the host copies are
pinned, and training after the reload equals training without the offload. The same
moves on the CPU engine: tests/runtime/engine/test_offload_states.py."""

import pytest
import torch

from tests.gpu.target import ON_CUDA, TOLERANCE, needs_target, run_ranks
from tests.runtime.engine.test_offload_states import RLHF_SET, _config, _train
from tests.runtime.zero.workers import relative_error

pytestmark = needs_target


def _allocated() -> int:
    return torch.cuda.memory_allocated() if ON_CUDA else 0


def _memory_around_offload(rank: int, world_size: int, config: dict, include: list | None) -> dict:
    import shardwise
    from tests.runtime.zero.workers import build_model, global_batch, make_optimizer, model_loss

    model = build_model("gpt")
    engine = shardwise.initialize(model, config, optimizer=make_optimizer(model, 1e-2))
    try:
        for micro in range(2):
            x, y = global_batch(micro, world_size * 2)
            engine.backward(model_loss(engine, "gpt", x[rank * 2:(rank + 1) * 2], y[rank * 2:(rank + 1) * 2]))
            engine.step()
        before = _allocated()
        moved = engine.offload_states(include=include)
        after = _allocated()
        pinned = all(parked.host is None or parked.host.is_pinned() for parked in engine.parked._parked)
        engine.reload_states()
        return {"moved": moved, "before": before, "after": after, "reloaded": _allocated(), "pinned": pinned}
    finally:
        engine.destroy()


@pytest.mark.parametrize("stage,bf16", [(2, True), (3, True), (3, False)])
def test_offloaded_states_free_device_memory_and_come_back(stage, bf16):
    for run in run_ranks(_memory_around_offload, _config(stage, bf16), None):
        assert run["moved"] > 0
        if ON_CUDA:
            assert run["pinned"]
            assert run["before"] - run["after"] >= 0.9 * run["moved"], run
            assert run["reloaded"] >= run["before"] - 0.1 * run["moved"], run


@pytest.mark.parametrize("include", [None, RLHF_SET], ids=["all", "rlhf"])
def test_training_after_the_reload_equals_training_without_it(include):
    config = _config(3, True)
    moved = run_ranks(_train, config, include, 2)
    plain = run_ranks(_train, config, None, 2)
    for rank_moved, rank_plain in zip(moved, plain):
        for name, value in rank_plain["params"].items():
            assert relative_error(rank_moved["params"][name], value) < TOLERANCE["fp32"], name
