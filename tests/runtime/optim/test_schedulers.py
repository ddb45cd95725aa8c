"""DeepSpeed's warm-up schedules give DeepSpeed's learning rates."""

import math

import pytest
import torch

from shardwise.runtime.optim import WarmupCosineLR, WarmupDecayLR, WarmupLR


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
