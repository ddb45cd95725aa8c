"""`deepspeed.utils.timer`: the named timers Megatron-DeepSpeed and other scripts keep
around their own phases (`timers("interval-time").start()`, `timers.log([...])`), and
`ThroughputTimer`, the samples-per-second meter, as DeepSpeed 0.19.8 names them.

Times are wall clock from the host (`time.perf_counter`); on a GPU the device is
synchronised at start and stop, so a phase's time includes the kernels it queued
(DeepSpeed records CUDA events instead, which leaves the host running on: the totals are
the same, the host's progress is not). Elapsed times are in milliseconds, as DeepSpeed's.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from shardwise.frontends.deepspeed.api.utils.logging import logger

__all__ = ["NoopTimer", "SynchronizedWallClockTimer", "ThroughputTimer", "trim_mean"]

FORWARD_MICRO_TIMER = "fwd_microstep"
FORWARD_GLOBAL_TIMER = "fwd"
BACKWARD_MICRO_TIMER = "bwd_microstep"
BACKWARD_GLOBAL_TIMER = "bwd"
BACKWARD_INNER_MICRO_TIMER = "bwd_inner_microstep"
BACKWARD_INNER_GLOBAL_TIMER = "bwd_inner"
BACKWARD_REDUCE_MICRO_TIMER = "bwd_allreduce_microstep"
BACKWARD_REDUCE_GLOBAL_TIMER = "bwd_allreduce"
STEP_MICRO_TIMER = "step_microstep"
STEP_GLOBAL_TIMER = "step"
TIME_EPSILON = 1e-6
GIB = 1024**3


def synchronize_accelerator() -> None:
    """Wait for the accelerator's queued work, so a host interval includes it (nothing on the CPU)."""
    if torch.accelerator.is_available():
        torch.accelerator.synchronize()


def _allocated(reading: Callable[[], int]) -> int:
    """A CUDA memory reading; 0 on the CPU, as shardwise's `get_accelerator()` reports there
    (DeepSpeed's CPU accelerator reports the process's resident memory)."""
    return reading() if torch.cuda.is_available() else 0


def _print_on_ranks(message: str, ranks: list[int]) -> None:
    """Print `message` prefixed with the rank on the listed ranks ([-1]: all); without a
    process group, always (DeepSpeed's `print_dist`: the log level does not silence it)."""
    if not dist.is_initialized():
        print(f"[Rank -1] {message}")
        return
    rank = dist.get_rank()
    if ranks and (ranks[0] == -1 or rank in set(ranks)):
        print(f"[Rank {rank}] {message}")


def trim_mean(data: list[float], trim_percent: float) -> float:
    """The mean of `data` without its `trim_percent` smallest and largest values (0 for none)."""
    assert 0.0 <= trim_percent <= 1.0
    if not data:
        return 0
    ordered = sorted(data)
    cut = int(round(len(ordered) * trim_percent))
    kept = ordered[cut:len(ordered) - cut]
    return sum(kept) / len(kept) if kept else float("nan")


class SynchronizedWallClockTimer:
    """Named timers, made on first use: `timers(name).start()`, `.stop()`,
    `.elapsed(reset=True)` (milliseconds summed over the start/stop intervals)."""

    class Timer:
        def __init__(self, name: str) -> None:
            self.name_ = name
            self.started_ = False
            self.start_time = 0.0
            self.end_time = 0.0
            self.event_timers: list[float] = []  # seconds of each finished interval
            self.elapsed_records: list[float] | None = None

        def start(self) -> None:
            assert not self.started_, f"{self.name_} timer has already been started"
            synchronize_accelerator()
            self.start_time = time.perf_counter()
            self.started_ = True

        def stop(self, reset: bool = False, record: bool = False) -> None:
            """`reset` and `record` are taken and, as in DeepSpeed, not used."""
            assert self.started_, "timer is not started"
            synchronize_accelerator()
            self.end_time = time.perf_counter()
            self.event_timers.append(self.end_time - self.start_time)
            self.started_ = False

        def _get_elapsed_msec(self) -> float:
            self.elapsed_records = [seconds * 1000.0 for seconds in self.event_timers]
            return sum(self.elapsed_records)

        def reset(self) -> None:
            self.started_ = False
            self.elapsed_records = None
            self.event_timers.clear()

        def elapsed(self, reset: bool = True) -> float:
            """Milliseconds so far (a running interval counts up to now and keeps running)."""
            running = self.started_
            if running:
                self.stop()
            elapsed = self._get_elapsed_msec()
            if reset:
                self.reset()
            if running:
                self.start()
            return elapsed

        def mean(self) -> float:
            """Trimmed mean (10% off each end) of the intervals, in milliseconds."""
            self.elapsed(reset=False)
            return trim_mean(self.elapsed_records, 0.1)

    def __init__(self) -> None:
        self.timers: dict[str, SynchronizedWallClockTimer.Timer] = {}

    def get_timers(self) -> dict[str, Timer]:
        return self.timers

    def __call__(self, name: str) -> Timer:
        if name not in self.timers:
            self.timers[name] = self.Timer(name)
        return self.timers[name]

    @staticmethod
    def memory_usage() -> str:
        figures = {"mem_allocated": _allocated(torch.cuda.memory_allocated),
                   "max_mem_allocated": _allocated(torch.cuda.max_memory_allocated),
                   "cache_allocated": _allocated(torch.cuda.memory_reserved),
                   "max_cache_allocated": _allocated(torch.cuda.max_memory_reserved)}
        return "".join(f" | {name}: {value / GIB:.4f} GB" for name, value in figures.items())

    def log(self, names: list[str], normalizer: float = 1.0, reset: bool = True, memory_breakdown: bool = False,
            ranks: list[int] | None = None) -> None:
        """Print "time (ms) | name: ms | ..." of the named timers that exist, each divided
        by `normalizer`, on `ranks` (default rank 0). `memory_breakdown` is taken and, as in
        DeepSpeed 0.19.8, not printed."""
        assert normalizer > 0.0
        line = "time (ms)"
        for name in names:
            if name in self.timers:
                line += f" | {name}: {self.timers[name].elapsed(reset=reset) / normalizer:.2f}"
        _print_on_ranks(line, ranks or [0])

    def get_mean(self, names: list[str], normalizer: float = 1.0, reset: bool = True) -> dict[str, float]:
        """{name: trimmed mean interval * 1000 / normalizer} of the named timers that exist
        (DeepSpeed's scale: the mean is already in milliseconds)."""
        assert normalizer > 0.0
        return {name: self.timers[name].mean() * 1000.0 / normalizer for name in names if name in self.timers}


class NoopTimer:
    """The timers' interface, doing nothing (DeepSpeed's engine uses it when
    `wall_clock_breakdown` is off)."""

    class Timer:
        def start(self) -> None:
            pass

        def reset(self) -> None:
            pass

        def stop(self, **kwargs: Any) -> None:
            pass

        def elapsed(self, **kwargs: Any) -> float:
            return 0

        def mean(self) -> float:
            return 0

    def __init__(self) -> None:
        self.timer = self.Timer()

    def __call__(self, name: str) -> Timer:
        return self.timer

    def get_timers(self) -> dict:
        return {}

    def log(self, names: list[str], normalizer: float = 1.0, reset: bool = True, memory_breakdown: bool = False,
            ranks: list[int] | None = None) -> None:
        pass

    def get_mean(self, names: list[str], normalizer: float = 1.0, reset: bool = True) -> None:
        return None


class ThroughputTimer:
    """Samples per second over the optimizer steps after the first `start_step` ones
    (warm-up excluded), reported every `steps_per_output` steps through `logging_fn`.
    `config`: an object with `enabled` and `synchronized` (DeepSpeed's timers config)."""

    def __init__(self, config: Any, batch_size: int | None, start_step: int = 2, steps_per_output: int | None = None,
                 monitor_memory: bool = False, logging_fn: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.start_time = 0.0
        self.end_time = 0.0
        self.started = False
        self.batch_size = 1 if batch_size is None else batch_size
        self.start_step = start_step
        self.epoch_count = 0
        self.micro_step_count = 0
        self.global_step_count = 0
        self.total_elapsed_time = 0.0
        self.step_elapsed_time = 0.0
        self.steps_per_output = steps_per_output
        self.monitor_memory = monitor_memory
        self.logging = logging_fn if logging_fn is not None else logger.info
        self.initialized = False
        if monitor_memory:
            import psutil  # noqa: F401  (DeepSpeed's requirement for the memory lines)

    def update_epoch_count(self) -> None:
        self.epoch_count += 1
        self.micro_step_count = 0

    def _init_timer(self) -> None:
        self.initialized = True

    def start(self) -> None:
        if not self.config.enabled:
            return
        self._init_timer()
        self.started = True
        if self.global_step_count >= self.start_step:
            if self.config.synchronized:
                synchronize_accelerator()
            self.start_time = time.time()

    def _is_report_boundary(self) -> bool:
        return self.steps_per_output is not None and self.global_step_count % self.steps_per_output == 0

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        if not self.config.enabled or not self.started:
            return
        self.started = False
        self.micro_step_count += 1
        if global_step:
            self.global_step_count += 1
        if self.start_time <= 0:
            return
        if self.config.synchronized:
            synchronize_accelerator()
        self.end_time = time.time()
        duration = self.end_time - self.start_time
        self.total_elapsed_time += duration
        self.step_elapsed_time += duration
        if not global_step:
            return
        if report_speed and self._is_report_boundary():
            self._report()
        self.step_elapsed_time = 0

    def _report(self) -> None:
        where = f"epoch={self.epoch_count}/micro_step={self.micro_step_count}/global_step={self.global_step_count}"
        self.logging(f"{where}, RunningAvgSamplesPerSec={self.avg_samples_per_sec()}, "
                     f"CurrSamplesPerSec={self.batch_size / (self.step_elapsed_time + TIME_EPSILON)}, "
                     f"MemAllocated={round(_allocated(torch.cuda.memory_allocated) / GIB, 2)}GB, "
                     f"MaxMemAllocated={round(_allocated(torch.cuda.max_memory_allocated) / GIB, 2)}GB")
        if self.monitor_memory:
            import psutil

            self.logging(f"{where}, vm %: {psutil.virtual_memory().percent}, swap %: {psutil.swap_memory().percent}")

    def avg_samples_per_sec(self) -> float:
        if self.global_step_count > 0:
            return self.batch_size / (self.total_elapsed_time / (self.global_step_count - self.start_step))
        return float("-inf")

