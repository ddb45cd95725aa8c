"""`deepspeed.utils.timer`: named timers summing their intervals (milliseconds), the line
`log` prints, trimmed means, the no-op timers, and the throughput meter's samples per
second after its warm-up steps (on a clock the test sets)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from shardwise.frontends.deepspeed.api.utils import timer as timer_module
from shardwise.frontends.deepspeed.api.utils.timer import (
    NoopTimer,
    SynchronizedWallClockTimer,
    ThroughputTimer,
    trim_mean,
)


class Clock:
    """time.perf_counter / time.time, advanced by the test."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(timer_module.time, "perf_counter", fake)
    monkeypatch.setattr(timer_module.time, "time", fake)
    return fake


def test_timers_sum_intervals_in_milliseconds_and_log_them(clock, capsys):
    timers = SynchronizedWallClockTimer()
    for seconds in (0.010, 0.030):
        timers("forward").start()
        clock.now += seconds
        timers("forward").stop()
    assert timers("forward").elapsed(reset=False) == pytest.approx(40.0)
    timers("forward").start()  # a running interval counts up to now, and keeps running
    clock.now += 0.005
    assert timers("forward").elapsed(reset=False) == pytest.approx(45.0)
    assert timers("forward").started_
    timers("forward").stop()
    assert set(timers.get_timers()) == {"forward"}
    timers.log(["forward", "never-started"], normalizer=5)  # no process group: printed as rank -1
    assert capsys.readouterr().out == "[Rank -1] time (ms) | forward: 9.00\n"
    assert timers("forward").elapsed() == 0.0  # log reset it
    with pytest.raises(AssertionError, match="timer is not started"):
        timers("forward").stop()
    timers("forward").start()
    with pytest.raises(AssertionError, match="forward timer has already been started"):
        timers("forward").start()


def test_mean_trims_a_tenth_off_each_end(clock):
    timers = SynchronizedWallClockTimer()
    for milliseconds in [1000] + [10] * 8 + [0]:
        timers("step").start()
        clock.now += milliseconds / 1000
        timers("step").stop()
    assert timers("step").mean() == pytest.approx(10.0)
    assert timers.get_mean(["step", "absent"], normalizer=2) == {"step": pytest.approx(5000.0)}
    assert trim_mean([], 0.1) == 0 and trim_mean([3.0, 1.0, 2.0], 0.0) == 2.0


def test_real_clock_measures_at_least_the_sleep():
    timers = SynchronizedWallClockTimer()
    timers("sleep").start()
    time.sleep(0.02)
    assert timers("sleep").elapsed() >= 20.0


def test_noop_timer_does_nothing():
    timers = NoopTimer()
    timers("x").start()
    timers("x").stop(reset=True)
    assert timers("x").elapsed(reset=False) == 0 and timers("x").mean() == 0
    assert timers.get_timers() == {} and timers.get_mean(["x"]) is None
    timers.log(["x"])


def test_throughput_counts_samples_per_second_after_warm_up(clock):
    lines = []
    meter = ThroughputTimer(SimpleNamespace(enabled=True, synchronized=False), batch_size=8, start_step=2,
                            steps_per_output=2, logging_fn=lines.append)
    for seconds in (5.0, 5.0, 0.5, 0.25, 0.25):  # the first two steps are warm-up, not timed
        meter.start()
        clock.now += seconds
        meter.stop(global_step=True)
    assert meter.global_step_count == 5 and meter.micro_step_count == 5
    assert meter.avg_samples_per_sec() == pytest.approx(8 / (1.0 / 3))
    assert [line.split(", ")[0] for line in lines] == ["epoch=0/micro_step=4/global_step=4"]
    assert "CurrSamplesPerSec=" in lines[0] and "MemAllocated=0.0GB" in lines[0]
    meter.update_epoch_count()
    assert (meter.epoch_count, meter.micro_step_count) == (1, 0)
    idle = ThroughputTimer(SimpleNamespace(enabled=False, synchronized=False), batch_size=None)
    idle.start()
    idle.stop(global_step=True)
    assert idle.global_step_count == 0 and idle.batch_size == 1 and idle.avg_samples_per_sec() == float("-inf")
