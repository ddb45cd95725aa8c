"""Where a training step's time goes: forward, backward, optimizer, waiting on collectives.

Collectives run asynchronously (gloo threads, NCCL streams), so communication only costs
the step the time it holds the computation up. Each phase's own time here is its time
minus the waits that happened inside it, and the waits are reported as one phase of
their own. The phases therefore add up to the step: forward + backward + optimizer +
comm_wait + data ≈ step.

- On the CPU the clock is the host's, and a wait is the time the training thread was
  blocked in it (the communicators add that up, `CommStats.wait_seconds`).
- On CUDA kernel launches and NCCL waits return before the work is done, so host time
  says nothing. Phases are bracketed by CUDA events on the current stream, NCCL waits
  too (`CommStats.device_waits`, recorded while a step is timed), and all of them are
  read at `end_step`, after one wait for the step's last event: the device is never
  synchronised inside a step, so timing does not take away the overlap it measures.
- A timer made with `enabled=False` only marks the phases for `torch.profiler` traces:
  no events, no synchronisation, and `end_step` returns None. Ranks whose timings
  nobody reads (all but the one writing metrics) use it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch

from shardwise.runtime.distributed.collectives import CommStats

PHASES = ("data", "forward", "backward", "optimizer")


@dataclass(frozen=True)
class StepTimes:
    """Seconds of one step by phase; `step` is the wall time of the whole step."""

    data: float
    forward: float
    backward: float
    optimizer: float
    comm_wait: float
    step: float

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass(frozen=True)
class _DevicePhase:
    """A phase on the device's timeline: its events and the slice of the step's waits
    recorded between them."""

    name: str
    began: torch.cuda.Event
    ended: torch.cuda.Event
    first_wait: int
    end_wait: int


class StepTimer:
    """Accumulates phase times over the micro-batches of one step."""

    def __init__(self, comm_stats: CommStats, device: torch.device, *, enabled: bool = True):
        """`comm_stats`: the engine's (`engine.comm_stats`), where its communicators
        count the time spent waiting on collectives."""
        self.enabled = enabled
        self._stats = comm_stats
        self._on_device = enabled and device.type == "cuda"
        self._phase_seconds = dict.fromkeys(PHASES, 0.0)
        self._comm_wait = 0.0
        self._step_started: float | None = None
        self._step_event: torch.cuda.Event | None = None
        self._device_phases: list[_DevicePhase] = []

    def start_step(self) -> None:
        self._phase_seconds = dict.fromkeys(PHASES, 0.0)
        self._comm_wait = 0.0
        self._step_started = time.perf_counter()
        if self._on_device:
            self._device_phases = []
            self._stats.device_waits = []
            self._step_event = _recorded_event()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if name not in PHASES:
            raise ValueError(f"unknown phase {name!r}; expected one of {PHASES}")
        if self._step_started is None:
            raise RuntimeError("call start_step() before timing a phase")
        if not self.enabled:
            with torch.profiler.record_function(name):
                yield
            return
        if self._on_device:
            began, first_wait = _recorded_event(), len(self._stats.device_waits)
            with torch.profiler.record_function(name):
                yield
            self._device_phases.append(
                _DevicePhase(name, began, _recorded_event(), first_wait, len(self._stats.device_waits))
            )
            return
        waited_before = self._stats.wait_seconds
        started = time.perf_counter()
        with torch.profiler.record_function(name):
            yield
        waited = self._stats.wait_seconds - waited_before
        self._phase_seconds[name] += time.perf_counter() - started - waited
        self._comm_wait += waited

    def end_step(self) -> StepTimes | None:
        """The step's times (None from a disabled timer). On CUDA this waits for the
        step's last event, the one device synchronisation a timed step makes."""
        if self._step_started is None:
            raise RuntimeError("end_step() without start_step()")
        elapsed = time.perf_counter() - self._step_started
        self._step_started = None
        if not self.enabled:
            return None
        if self._on_device:
            elapsed = self._read_device_times()
        return StepTimes(**self._phase_seconds, comm_wait=self._comm_wait, step=elapsed)

    def _read_device_times(self) -> float:
        """Fill the phase times from the step's events; returns the step's seconds."""
        ended = _recorded_event()
        ended.synchronize()
        waits = [began.elapsed_time(until) / 1e3 for began, until in self._stats.device_waits]
        self._stats.device_waits = None  # nothing records waits between timed steps
        for phase in self._device_phases:
            waited = sum(waits[phase.first_wait : phase.end_wait])
            self._phase_seconds[phase.name] += phase.began.elapsed_time(phase.ended) / 1e3 - waited
            self._comm_wait += waited
        return self._step_event.elapsed_time(ended) / 1e3


def _recorded_event() -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event
