"""Where a training step's time goes: forward, backward, optimizer, waiting on collectives.

Collectives run asynchronously (gloo threads, NCCL streams), so communication only costs
the training thread the time it is *blocked* in a wait. The engine's communicator adds
that up (`comm.wait_seconds`); each phase's own time here is its wall time minus the
waits that happened inside it, and the waits are reported as one phase of their own.
The phases therefore add up to the step: forward + backward + optimizer + comm_wait +
data ≈ step.

Each phase is also a `torch.profiler.record_function` range, so profiler traces show
the same split. On CUDA the timer synchronizes at phase boundaries, because kernel
launches return before the work is done.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch

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


class StepTimer:
    """Accumulates phase times over the micro-batches of one step."""

    def __init__(self, wait_seconds: Callable[[], float], device: torch.device):
        """`wait_seconds()` returns the cumulative seconds blocked on collectives."""
        self._wait_seconds = wait_seconds
        self._synchronize = torch.cuda.synchronize if device.type == "cuda" else None
        self._phase_seconds = dict.fromkeys(PHASES, 0.0)
        self._comm_wait = 0.0
        self._step_started: float | None = None

    def start_step(self) -> None:
        self._phase_seconds = dict.fromkeys(PHASES, 0.0)
        self._comm_wait = 0.0
        self._step_started = time.perf_counter()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if name not in PHASES:
            raise ValueError(f"unknown phase {name!r}; expected one of {PHASES}")
        if self._step_started is None:
            raise RuntimeError("call start_step() before timing a phase")
        waited_before = self._wait_seconds()
        started = time.perf_counter()
        with torch.profiler.record_function(name):
            yield
            if self._synchronize is not None:
                self._synchronize()
        waited = self._wait_seconds() - waited_before
        self._phase_seconds[name] += time.perf_counter() - started - waited
        self._comm_wait += waited

    def end_step(self) -> StepTimes:
        if self._step_started is None:
            raise RuntimeError("end_step() without start_step()")
        elapsed = time.perf_counter() - self._step_started
        self._step_started = None
        return StepTimes(**self._phase_seconds, comm_wait=self._comm_wait, step=elapsed)
