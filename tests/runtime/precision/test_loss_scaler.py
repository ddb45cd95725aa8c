"""fp16 loss scaling: DeepSpeed's dynamic schedule, and overflow skipping across ranks."""

import math

import torch

import shardwise
from shardwise.runtime.precision import LossScaler
from shardwise.tools.testing import run_distributed
from tests.runtime.zero.workers import build_model, global_batch, make_optimizer


def test_dynamic_scale_halves_after_hysteresis_and_doubles_after_window():
    scaler = LossScaler(2.0**16, dynamic=True, scale_window=3, hysteresis=2, min_scale=1.0)
    scaler.update(overflow=True)  # first overflow is absorbed by hysteresis
    assert scaler.scale == 2.0**16
    scaler.update(overflow=True)
    assert scaler.scale == 2.0**15
    for _ in range(2):
        scaler.update(overflow=False)
    assert scaler.scale == 2.0**15
    scaler.update(overflow=False)  # 3 clean steps since the last overflow
    assert scaler.scale == 2.0**16


def test_scale_never_drops_below_minimum():
    scaler = LossScaler(4.0, dynamic=True, hysteresis=1, min_scale=2.0)
    for _ in range(5):
        scaler.update(overflow=True)
    assert scaler.scale == 2.0


def test_static_scale_never_changes():
    scaler = LossScaler(128.0)
    scaler.update(overflow=True)
    scaler.update(overflow=False)
    assert scaler.scale == 128.0


def test_state_round_trip():
    scaler = LossScaler(2.0**10, dynamic=True, hysteresis=3)
    scaler.update(overflow=True)
    restored = LossScaler(1.0, dynamic=True, hysteresis=3)
    restored.load_state_dict(scaler.state_dict())
    assert restored.state_dict() == scaler.state_dict()


def _train_fp16_with_overflow(rank: int, world_size: int, stage: int, bad_step: int, bad_rank: int = 1) -> dict:
    """fp16 training where only `bad_rank` overflows at `bad_step` (an injected inf)."""
    model = build_model("gpt")
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000},
        "fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1},
    }
    engine = shardwise.initialize(model, config, optimizer=make_optimizer(model, 1e-2))
    snapshots, scales = [], []
    for step in range(4):
        x, y = global_batch(step, 2 * world_size)
        rows = slice(2 * rank, 2 * rank + 2)
        loss = engine(x[rows].to(engine.device), y[rows].to(engine.device))
        if step == bad_step and rank == bad_rank:
            loss = loss * math.inf
        engine.backward(loss)
        engine.step()
        snapshots.append(torch.cat([p.detach().float().flatten() for p in model.parameters()]).cpu())
        scales.append(engine.loss_scale)
    return {"snapshots": snapshots, "scales": scales, "skipped": engine.skipped_steps}


def test_overflow_on_one_rank_skips_the_step_on_all_ranks():
    for stage in (0, 2):
        results = run_distributed(_train_fp16_with_overflow, 2, stage, 2)
        for result in results:
            snapshots = result["snapshots"]
            assert result["skipped"] == 1
            assert torch.equal(snapshots[2], snapshots[1]), "the overflowing step changed weights"
            assert not torch.equal(snapshots[3], snapshots[2]), "training did not resume"
            assert torch.isfinite(snapshots[3]).all()
            assert result["scales"] == [256.0, 256.0, 128.0, 128.0]
        assert torch.equal(results[0]["snapshots"][3], results[1]["snapshots"][3])
