"""DeepSpeed's learning-rate schedules give DeepSpeed's learning rates, at every step."""

import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch

from shardwise.runtime.optim import WarmupCosineLR, WarmupDecayLR, WarmupLR
from shardwise.runtime.optim.schedulers import SCHEDULERS


def optimizer(lr: float = 0.1) -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)


def lrs(scheduler, steps: int) -> list[float]:
    """The lr each of `steps` optimizer steps runs at (the first at iteration -1)."""
    values = []
    for _ in range(steps):
        values.append(scheduler.get_last_lr()[0])
        scheduler.step()
    return values


def test_warmup_lr_log_then_constant():
    values = lrs(WarmupLR(optimizer(), warmup_min_lr=0.01, warmup_max_lr=0.1, warmup_num_steps=10), 15)
    assert values[0] == pytest.approx(0.01), "like DeepSpeed, the first update runs at the minimum"
    for iteration in range(10):
        assert values[iteration + 1] == pytest.approx(0.01 + 0.09 * math.log(iteration + 1) / math.log(10))
    assert values[11:] == [pytest.approx(0.1)] * 4


def test_warmup_lr_defaults_to_the_optimizer_lr():
    values = lrs(WarmupLR(optimizer(0.3), warmup_num_steps=2, warmup_type="linear"), 5)
    assert values == pytest.approx([0.0, 0.0, 0.15, 0.3, 0.3])


def test_warmup_lr_linear():
    values = lrs(WarmupLR(optimizer(), 0.0, 1.0, warmup_num_steps=4, warmup_type="linear"), 7)
    assert values == pytest.approx([0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 1.0])


def test_warmup_decay_lr_reaches_zero_at_total_steps():
    scheduler = WarmupDecayLR(optimizer(), total_num_steps=10, warmup_max_lr=1.0, warmup_num_steps=2, warmup_type="linear")
    values = lrs(scheduler, 13)[1:]  # by iteration
    assert values[:2] == pytest.approx([0.0, 0.5])
    assert values[2] == pytest.approx(1.0)
    assert values[6] == pytest.approx(0.5)
    assert values[10:] == [0.0, 0.0]


def test_warmup_cosine_is_a_ratio_of_the_optimizer_lr():
    scheduler = WarmupCosineLR(optimizer(0.2), total_num_steps=12, warmup_num_steps=2, warmup_type="linear", cos_min_ratio=0.1)
    values = lrs(scheduler, 14)
    assert values[0] == 0.0
    values = values[1:]  # by iteration
    assert values[0] == pytest.approx(0.0)
    assert values[1] == pytest.approx(0.1)
    done, span = 1, 10  # step 2 is the first cosine step
    assert values[2] == pytest.approx(0.2 * (0.1 + 0.9 * (1 + math.cos(math.pi * done / span)) / 2))
    assert values[11] == pytest.approx(0.2 * 0.1)


def test_state_dict_resumes_the_schedule():
    first = WarmupLR(optimizer(), 0.0, 1.0, warmup_num_steps=8)
    lrs(first, 5)
    second = WarmupLR(optimizer(), 0.0, 1.0, warmup_num_steps=8)
    second.load_state_dict(first.state_dict())
    assert second.get_last_lr() == first.get_last_lr()


# Every DeepSpeed schedule, at its edges: the first steps, the max(2, warmup_num_steps) floor,
# per-group lists, past total_num_steps, OneCycle's stairs, decay and momentum. Each runs on an
# Adam optimizer with two param groups (lr 0.1 and 0.05); every lr, beta1 and beta2 is recorded
# at construction and after each step.
CASES = {
    "warmup_log": ("WarmupLR", {"warmup_min_lr": 0.01, "warmup_max_lr": 0.2, "warmup_num_steps": 10}, 14),
    "warmup_floor_of_two": ("WarmupLR", {"warmup_num_steps": 1, "warmup_type": "linear"}, 4),
    "warmup_per_group": ("WarmupLR", {"warmup_min_lr": [0.0, 0.01], "warmup_max_lr": [0.3, 0.02],
                                      "warmup_num_steps": 5, "warmup_type": "linear"}, 8),
    "warmup_decay": ("WarmupDecayLR", {"total_num_steps": 12, "warmup_max_lr": 0.5, "warmup_num_steps": 4}, 15),
    "warmup_cosine_past_the_end": ("WarmupCosineLR", {"total_num_steps": 12, "warmup_num_steps": 3,
                                                      "warmup_min_ratio": 0.1, "cos_min_ratio": 0.05}, 16),
    "warmup_cosine_floor_of_two": ("WarmupCosineLR", {"total_num_steps": 5, "warmup_num_steps": 1,
                                                      "warmup_type": "linear"}, 7),
    "one_cycle_with_decay": ("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 4,
                                          "cycle_second_step_size": 3, "decay_step_size": 2, "decay_lr_rate": 0.5,
                                          "decay_mom_rate": 0.1}, 12),
    "one_cycle_stairs": ("OneCycle", {"cycle_min_lr": [0.01, 0.02], "cycle_max_lr": 0.1, "cycle_first_step_size": 6,
                                      "cycle_first_stair_count": 3}, 14),
    "range_test": ("LRRangeTest", {"lr_range_test_min_lr": 0.001, "lr_range_test_step_size": 3,
                                   "lr_range_test_step_rate": 2.0}, 7),
    "range_test_staircase": ("LRRangeTest", {"lr_range_test_min_lr": [0.001, 0.002], "lr_range_test_step_size": 3,
                                             "lr_range_test_staircase": True}, 7),
}
# What DeepSpeed 0.19.8's own classes give for CASES (written out by running DEEPSPEED_SIDE).
DEEPSPEED_VALUES = Path(__file__).parent / "deepspeed_lr_schedules.json"

DEEPSPEED_SIDE = """
import json, sys
import torch
from deepspeed.runtime import lr_schedules

out = {}
for name, (cls, params, steps) in json.loads(sys.argv[1]).items():
    optimizer = torch.optim.Adam([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.1},
                                  {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.05}])
    scheduler = getattr(lr_schedules, cls)(optimizer, **params)
    seen = []
    for _ in range(steps + 1):
        seen.append([[group["lr"], *group["betas"]] for group in optimizer.param_groups])
        scheduler.step()
    out[name] = seen
print(json.dumps(out))
"""


def shardwise_values(name: str) -> list[list[list[float]]]:
    cls, params, steps = CASES[name]
    optimizer = torch.optim.Adam([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.1},
                                  {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.05}])
    scheduler = SCHEDULERS[cls](optimizer, **params)
    seen = []
    for _ in range(steps + 1):
        seen.append([[group["lr"], *group["betas"]] for group in optimizer.param_groups])
        scheduler.step()
    return seen


@pytest.mark.parametrize("name", CASES)
def test_equals_deepspeeds_values(name):
    """Against the values DeepSpeed 0.19.8's classes computed for the same cases; the same
    floating-point order makes them equal to the last bit."""
    assert shardwise_values(name) == json.loads(DEEPSPEED_VALUES.read_text())[name]


@pytest.mark.skipif(not os.environ.get("DEEPSPEED_PYTHON"), reason="set DEEPSPEED_PYTHON to an interpreter with "
                    "DeepSpeed installed (benchmarks/zero3_vs_fsdp2_deepspeed.py's docstring shows one)")
def test_equals_deepspeeds_own_classes():
    """The same cases through DeepSpeed's own classes, now; the recorded values must still be theirs."""
    ran = subprocess.run([os.environ["DEEPSPEED_PYTHON"], "-c", DEEPSPEED_SIDE, json.dumps(CASES)], check=True,
                         capture_output=True, text=True, timeout=300, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    theirs = json.loads(ran.stdout.strip().splitlines()[-1])
    assert theirs == json.loads(DEEPSPEED_VALUES.read_text())
    for name in CASES:
        assert shardwise_values(name) == theirs[name], name


def test_the_engine_steps_the_schedule_after_each_applied_update():
    """As DeepSpeed's engine: the schedule steps once per optimizer step (not per
    micro-batch), after the update, and not after an update an fp16 overflow skipped; so
    update k runs at the schedule's rate of iteration k - 1 (-1: its minimum)."""
    import shardwise

    cls, params, _ = CASES["warmup_log"]
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}, "scheduler": {"type": cls, "params": params},
              "fp16": {"enabled": True, "initial_scale_power": 17, "hysteresis": 1}}  # 2**17 overflows fp16 at first
    engine = shardwise.initialize(model, config)
    rates, skipped = [], []
    for _ in range(6):
        for _ in range(2):
            lr_before = engine.get_lr()[0]
            loss = engine(torch.randn(2, 4)).float().pow(2).mean()
            engine.backward(loss)
            skips = engine.skipped_steps
            engine.step()
        rates.append(lr_before)
        skipped.append(engine.skipped_steps > skips)
    engine.destroy()
    deepspeeds = [step[0][0] for step in json.loads(DEEPSPEED_VALUES.read_text())["warmup_log"]]
    applied = 0
    for rate, was_skipped in zip(rates, skipped):
        assert rate == deepspeeds[applied]  # the rate after `applied` updates
        applied += not was_skipped
    assert any(skipped) and not all(skipped)


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_a_tensor_lr_is_filled_in_place(name):
    """An optimizer built with a tensor lr keeps that tensor: construction and every step fill it."""
    initial = torch.full((1,), 0.1, dtype=torch.float64)
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=initial)
    params = {"WarmupLR": {"warmup_num_steps": 10}, "WarmupDecayLR": {"total_num_steps": 100, "warmup_num_steps": 10},
              "WarmupCosineLR": {"total_num_steps": 100, "warmup_num_steps": 10}, "LRRangeTest": {},
              "OneCycle": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 10}}[name]
    scheduler = SCHEDULERS[name](sgd, **params)
    scheduler.step(1)
    lr = sgd.param_groups[0]["lr"]
    assert lr is initial and lr.shape == (1,) and lr.dtype == torch.float64
    assert lr.item() == pytest.approx(scheduler.get_lr()[0])


@pytest.mark.parametrize("steps", [None, 0, -5, 2.5])
def test_warmup_num_steps_must_be_a_positive_integer(steps):
    with pytest.raises(ValueError, match="warmup_num_steps must be a positive integer"):
        WarmupLR(optimizer(), warmup_num_steps=steps)


def test_an_unknown_warmup_type_warms_up_logarithmically():
    unknown = WarmupCosineLR(optimizer(), total_num_steps=100, warmup_num_steps=10, warmup_type="cubic")
    assert unknown.warmup_type == "log"
    unknown.step(1)
    assert unknown.get_lr_ratio() == pytest.approx(math.log(2) / math.log(10))
