"""`torch.profiler` traces of a few training steps, in the layout TensorBoard reads.

The first step is skipped (it records the stage-3 gather trace and allocates buffers, so
it is not typical) and one warm-up step lets the profiler settle; then `active` steps are
recorded. Every rank writes its own trace, named after its rank, into one directory:
`tensorboard --logdir <dir>` shows them side by side (the PyTorch profiler plugin,
`torch-tb-profiler`, renders them), and each `*.pt.trace.json` also opens in
chrome://tracing or Perfetto.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

TRACE_SUFFIX = ".pt.trace.json"
SKIPPED_STEPS = 1
WARMUP_STEPS = 1
ACTIVE_STEPS = 3


def steps_needed(active: int = ACTIVE_STEPS) -> int:
    """Training steps a run needs for a trace of `active` steps."""
    return SKIPPED_STEPS + WARMUP_STEPS + active


@contextmanager
def profile_steps(
    log_dir: str | os.PathLike | None, worker_name: str, active: int = ACTIVE_STEPS
) -> Iterator[Callable[[], None]]:
    """Profile a window of steps into `log_dir`; yields the function to call after each step.

    With `log_dir` None nothing is recorded and the function does nothing, so a training
    loop is written once for both cases.
    """
    if log_dir is None:
        yield lambda: None
        return
    if active < 1:
        raise ValueError(f"active must be at least 1 step, got {active}")
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(
        activities=activities,
        schedule=schedule(wait=SKIPPED_STEPS, warmup=WARMUP_STEPS, active=active, repeat=1),
        on_trace_ready=tensorboard_trace_handler(os.fspath(log_dir), worker_name=worker_name),
        record_shapes=True,
        profile_memory=True,
    ) as profiler:
        yield profiler.step
