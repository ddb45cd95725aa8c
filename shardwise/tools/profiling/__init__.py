"""Profiling (C21): per-step time split, MFU against a device peak, process memory, and
`torch.profiler` traces for TensorBoard."""

from shardwise.tools.profiling.flops import (
    PeakFlops,
    device_peak_flops,
    measure_matmul_flops,
    model_flops_utilization,
    table_peak_flops,
)
from shardwise.tools.profiling.process_memory import memory_kind, process_memory
from shardwise.tools.profiling.step_timer import StepTimer, StepTimes
from shardwise.tools.profiling.trace import TRACE_SUFFIX, profile_steps, steps_needed

__all__ = [
    "TRACE_SUFFIX",
    "PeakFlops",
    "StepTimer",
    "StepTimes",
    "device_peak_flops",
    "measure_matmul_flops",
    "memory_kind",
    "model_flops_utilization",
    "process_memory",
    "profile_steps",
    "steps_needed",
    "table_peak_flops",
]
