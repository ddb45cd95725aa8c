"""Windows the caller ends (`TrainingPolicy.caller_ends_windows`, DeepSpeed's
`managed_gradient_accumulation: false`): backward() only accumulates, and every step()
ends the window, however many backward passes it holds. On 2 gloo ranks at every ZeRO
stage, with windows of 3, 1 and 2 micro-batches and each loss divided by the config's
gradient_accumulation_steps (2), the weights equal a single process that sums the same
micro-batches' gradients so divided (fp32, relative error < 1e-5; SGD without clipping,
whose step shows any error in the gradient's scale). Also: windows of no_sync backwards,
hybrid sharding's replica sum at the window's end, and a failed backward dropping the
window so far. DeepSpeed's side
(the config key, its refusals, DeepSpeed 0.19.8's own weights) is in
tests/frontends/deepspeed/config/test_managed_gradient_accumulation.py."""

from __future__ import annotations

import contextlib

import pytest

import shardwise
from shardwise.tools.testing import run_distributed
from tests.runtime.engine.test_output_backward import RaiseInBackward
from tests.runtime.zero.workers import build_model, global_batch, make_optimizer, model_loss, relative_error

WINDOWS = (3, 1, 2)  # micro-batches (backward passes) per step
ACCUMULATION = 2  # the config's count: what each loss is divided by
MICRO = 2
LR = 0.05
TOLERANCE = 1e-5


def _config(stage: int, **zero: object) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUMULATION,
            "managed_gradient_accumulation": False,
            "zero_optimization": {"stage": stage, "overlap_comm": stage >= 2, "reduce_bucket_size": 3000,
                                  "allgather_bucket_size": 3000, **zero}}


def _rows(micro: int, rank: int, world_size: int) -> slice:
    start = (micro * world_size + rank) * MICRO
    return slice(start, start + MICRO)


def _train(rank: int, world_size: int, config: dict, fail_at: tuple[int, int] | None = None,
           in_no_sync: bool = False) -> dict:
    """`fail_at` (step, micro-batch): that backward raises on every rank. `in_no_sync`:
    every backward runs inside engine.no_sync()."""
    model = build_model("gpt")
    engine = shardwise.initialize(model, config, optimizer=make_optimizer(model, LR, "sgd"))
    boundaries = []
    try:
        for step, window in enumerate(WINDOWS):
            x, y = global_batch(step, world_size * window * MICRO)
            for micro in range(window):
                rows = _rows(micro, rank, world_size)
                loss = model_loss(engine, "gpt", x[rows], y[rows])
                boundaries.append(engine.is_gradient_accumulation_boundary())
                if fail_at == (step, micro):
                    with pytest.raises(RuntimeError, match="a kernel failed in backward"):
                        engine.backward(RaiseInBackward.apply(loss))
                    continue
                with engine.no_sync() if in_no_sync else contextlib.nullcontext():
                    engine.backward(loss)
            engine.step()
        with shardwise.gathered_parameters(list(model.parameters())):
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
        return {"params": params, "boundaries": boundaries, "global_steps": engine.global_steps,
                "skipped": engine.skipped_steps}
    finally:
        engine.destroy()


def _reference(world_size: int, failed_at: tuple[int, int] | None = None) -> dict:
    """One process: per window, the micro-batches of every rank, each loss divided by
    ACCUMULATION and by the ranks (their mean), summed; one SGD step per window. At
    `failed_at` (step, micro-batch) the window's gradients so far are dropped with the
    failed backward, and the window goes on with the next micro-batch."""
    model = build_model("gpt")
    optimizer = make_optimizer(model, LR, "sgd")
    for step, window in enumerate(WINDOWS):
        x, y = global_batch(step, world_size * window * MICRO)
        for micro in range(window):
            if (step, micro) == failed_at:
                optimizer.zero_grad()
                continue
            for rank in range(world_size):
                rows = _rows(micro, rank, world_size)
                (model_loss(model, "gpt", x[rows], y[rows]) / (ACCUMULATION * world_size)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_each_step_ends_a_window_of_any_length(stage):
    expected = _reference(2)
    for result in run_distributed(_train, 2, _config(stage)):
        for name, want in expected.items():
            assert relative_error(result["params"][name], want) < TOLERANCE, name
        assert result["global_steps"] == len(WINDOWS) and not any(result["boundaries"])


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_with_the_optimizer_offloaded(stage):
    """ZeRO-Offload: the window's reduced gradients reach the host partition (stage 1 in
    step(), stages 2-3 in every backward) before the host's update."""
    expected = _reference(2)
    result = run_distributed(_train, 2, _config(stage, offload_optimizer={"device": "cpu"}))[0]
    for name, want in expected.items():
        assert relative_error(result["params"][name], want) < TOLERANCE, name


@pytest.mark.parametrize("stage", [0, 1])
def test_a_window_of_no_sync_backwards_is_reduced_in_step(stage):
    """Every backward inside engine.no_sync() (stages 0-1): step() still ends the window,
    reducing what accumulated, as DeepSpeed's step() does in this mode."""
    expected = _reference(2)
    result = run_distributed(_train, 2, _config(stage), None, True)[0]
    for name, want in expected.items():
        assert relative_error(result["params"][name], want) < TOLERANCE, name


def test_hybrid_sharding_sums_the_replicas_at_the_window_end():
    """Stage 2 over 2 shard groups of 2 (mics_shard_size): the owned chunks are summed over
    the replicas in step(), after the window's last backward."""
    expected = _reference(4)
    result = run_distributed(_train, 4, _config(2, mics_shard_size=2))[0]
    for name, want in expected.items():
        assert relative_error(result["params"][name], want) < TOLERANCE, name


def test_a_failed_backward_drops_the_window_so_far():
    """The second micro-batch of the first window raises: the window's gradients so far
    (the first micro-batch's too) are dropped, counted as a skipped step, and the window
    goes on: its step applies the third micro-batch's gradients."""
    expected = _reference(2, failed_at=(0, 1))
    result = run_distributed(_train, 2, _config(1), (0, 1))[0]
    assert result["skipped"] == 1
    for name, want in expected.items():
        assert relative_error(result["params"][name], want) < TOLERANCE, name
