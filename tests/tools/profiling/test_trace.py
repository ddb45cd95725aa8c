"""`profile_steps` writes a TensorBoard-readable torch.profiler trace of the chosen steps."""

import json

import torch

from shardwise.tools.profiling import TRACE_SUFFIX, profile_steps, steps_needed


def test_trace_of_the_active_steps_is_written(tmp_path):
    a = torch.randn(64, 64)
    with profile_steps(tmp_path, "rank0", active=2) as step:
        for _ in range(steps_needed(2)):
            with torch.profiler.record_function("forward"):
                a @ a
            step()
    traces = list(tmp_path.glob(f"rank0*{TRACE_SUFFIX}"))
    assert len(traces) == 1
    events = json.loads(traces[0].read_text())["traceEvents"]
    assert sum(event.get("name") == "forward" for event in events) == 2
    assert any(event.get("name") == "aten::mm" for event in events)


def test_without_a_directory_nothing_is_recorded(tmp_path):
    with profile_steps(None, "rank0") as step:
        step()
    assert steps_needed() == 5
    assert list(tmp_path.iterdir()) == []
