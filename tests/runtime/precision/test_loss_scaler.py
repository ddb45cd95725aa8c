"""fp16 loss scaling: DeepSpeed's dynamic schedule, and overflow skipping across ranks."""

import json
import math
import os
import subprocess

import pytest
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
    for _ in range(3):
        scaler.update(overflow=False)
    assert scaler.scale == 2.0**15
    scaler.update(overflow=False)  # 3 clean steps between the last overflow and this one
    assert scaler.scale == 2.0**16


def scales(sequence: list[bool], window: int, hysteresis: int, consecutive: bool = False) -> list[int]:
    scaler = LossScaler(2.0**16, dynamic=True, scale_window=window, hysteresis=hysteresis,
                        consecutive_hysteresis=consecutive, min_scale=1.0)
    seen = []
    for overflow in sequence:
        scaler.update(overflow=overflow)
        seen.append(int(scaler.scale))
    return seen


# (overflows, window, hysteresis, consecutive_hysteresis) -> the scales DeepSpeed 0.19.8's
# DynamicLossScaler.update_scale gives after each step (run with it; see the test below)
SEQUENCES = [
    (([True, True] + [False] * 7, 3, 2, False), [65536, 32768, 32768, 32768, 32768, 65536, 65536, 65536, 131072]),
    (([False] * 6, 2, 2, False), [65536, 65536, 131072, 131072, 262144, 262144]),
    (([False, True, False, True, True, False, False, False, False], 2, 2, True),
     [65536, 65536, 65536, 65536, 32768, 32768, 32768, 65536, 65536]),
]


def test_the_schedule_is_deepspeed_s():
    for arguments, expected in SEQUENCES:
        assert scales(*arguments) == expected, arguments


DEEPSPEED_SIDE = """
import json, sys
import deepspeed.runtime.fp16.loss_scaler as loss_scaler
loss_scaler.dist.get_rank = lambda *args, **kwargs: 0  # it logs from rank 0; no process group here
out = []
for sequence, window, hysteresis, consecutive in json.loads(sys.argv[1]):
    scaler = loss_scaler.DynamicLossScaler(init_scale=2**16, scale_window=window, delayed_shift=hysteresis,
                                           min_scale=1, consecutive_hysteresis=consecutive)
    seen = []
    for overflow in sequence:
        scaler.update_scale(overflow)
        seen.append(int(scaler.cur_scale))
    out.append(seen)
print(json.dumps(out))
"""


@pytest.mark.skipif(not os.environ.get("DEEPSPEED_PYTHON"), reason="set DEEPSPEED_PYTHON to an interpreter with "
                    "DeepSpeed 0.19.8 installed")
def test_deepspeed_s_own_scaler_gives_the_same_sequences():
    ran = subprocess.run([os.environ["DEEPSPEED_PYTHON"], "-c", DEEPSPEED_SIDE,
                          json.dumps([arguments for arguments, _ in SEQUENCES])], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert json.loads(ran.stdout.strip().splitlines()[-1]) == [expected for _, expected in SEQUENCES]


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
        scales.append(engine.loss_scaler.scale)
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
