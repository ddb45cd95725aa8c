"""`engine.tput_timer` is DeepSpeed's `deepspeed.utils.timer.ThroughputTimer`, driven as
DeepSpeed's engine drives it: started when a micro-batch's forward begins (or when the
loader `initialize` built reads it), stopped at every `step()`, a global step at each
accumulation boundary; samples per second over the updates after the first two."""

import torch
from torch import nn

import shardwise.frontends.deepspeed.api as deepspeed
from shardwise.frontends.deepspeed.api.utils.timer import ThroughputTimer

ACCUMULATION, UPDATES, MICRO = 2, 4, 2


def _engine(training_data=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUMULATION,
              "optimizer": {"type": "SGD", "params": {"lr": 1e-2}}}
    return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                training_data=training_data)


def _check(timer: ThroughputTimer) -> None:
    assert isinstance(timer, ThroughputTimer)
    assert timer.batch_size == MICRO * ACCUMULATION  # the train batch: micro x accumulation x data ranks (1)
    assert (timer.micro_step_count, timer.global_step_count) == (ACCUMULATION * UPDATES, UPDATES)
    assert timer.avg_samples_per_sec() > 0  # timed from the third update on, as DeepSpeed's


def test_the_timer_counts_micro_and_global_steps_started_by_forward():
    engine, _, _, _ = _engine()
    for _ in range(ACCUMULATION * UPDATES):
        engine.backward(engine(torch.randn(MICRO, 4)).sum())
        engine.step()
    _check(engine.tput_timer)


def test_the_loader_initialize_builds_starts_the_timer_as_it_reads():
    data = torch.utils.data.TensorDataset(torch.randn(MICRO * ACCUMULATION * UPDATES, 4))
    engine, _, loader, _ = _engine(training_data=data)
    assert loader.tput_timer is engine.tput_timer
    for (inputs,) in loader:
        assert engine.tput_timer.started  # by the loader, before any forward
        engine.backward(engine(inputs).sum())
        engine.step()
        assert not engine.tput_timer.started
    _check(engine.tput_timer)
