"""The config's `flops_profiler` block on the engine `deepspeed.initialize` returns: at
`profile_step` rank 0 profiles each forward and prints DeepSpeed's profile at that
micro-batch's `step()`, as DeepSpeed 0.19.8's engine does (compared with it when
DEEPSPEED_PYTHON names an interpreter with DeepSpeed)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import shardwise.frontends.deepspeed.api as deepspeed
from shardwise.frontends.deepspeed.api.profiling.flops_profiler import number_to_string
from shardwise.frontends.deepspeed.config import ConfigError, load_config
from shardwise.tools.testing import run_distributed

needs_deepspeed = pytest.mark.skipif(not os.environ.get("DEEPSPEED_PYTHON"), reason="set DEEPSPEED_PYTHON to an "
                                     "interpreter with DeepSpeed 0.19.8 to compare with it")


def _profile_at_step_one(rank: int, world_size: int, report: str) -> list:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 2},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
              "flops_profiler": {"enabled": True, "profile_step": 1, "top_modules": 2, "output_file": report}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    written = []
    for micro_step in range(6):
        engine.backward(engine(torch.randn(2, 8)).sum())
        engine.step()
        if rank == 0 and os.path.exists(report):
            written.append((micro_step, Path(report).read_text()))
            os.unlink(report)
    assert not any(hasattr(m, "__flops__") for m in model.modules())  # end_profile cleaned up
    engine.destroy()
    return written


def _line(label: str, value: object) -> str:
    return "{:<70}  {:<8}".format(label, value)


def test_the_profile_step_is_profiled_and_written_on_rank_zero(tmp_path):
    written = run_distributed(_profile_at_step_one, 2, str(tmp_path / "profile" / "flops.txt"))
    assert [micro_step for micro_step, _ in written[0]] == [2, 3] and written[1] == []  # step 1's micro-batches
    for (micro_step, text), step in zip(written[0], (1, 2)):  # the step count step() left, as DeepSpeed prints
        assert text.count("Profile Summary") == 1 and f"Profile Summary at step {step}:" in text
        for line in (_line("world size: ", 2), _line("data parallel size: ", 2), _line("model parallel size: ", 1),
                     _line("batch size per GPU: ", 2), _line("params per GPU: ", "212"),
                     _line("fwd MACs per GPU: ", "384 MACs"), _line("fwd flops per GPU: ", "768 ")):
            assert line in text.splitlines()
        assert "bwd latency: " in text and "samples/second: " in text and "(1): GELU(0 = 0% Params" in text


def test_the_block_is_validated():
    resolved = load_config({"train_micro_batch_size_per_gpu": 1, "flops_profiler": {"enabled": True}}, world_size=1)
    assert (resolved.flops_profiler.profile_step, resolved.flops_profiler.top_modules) == (1, 1)
    with pytest.raises(ConfigError, match="flops_profiler.profile_step"):
        load_config({"train_micro_batch_size_per_gpu": 1, "flops_profiler": {"profile_step": -1}}, world_size=1)
    with pytest.raises(ConfigError, match="flops_profiler.top_module"):
        load_config({"train_micro_batch_size_per_gpu": 1, "flops_profiler": {"top_module": 3}}, world_size=1)


SCRIPT = """
import os, socket, sys
if sys.argv[1] == "shardwise":
    from shardwise.frontends.deepspeed.alias import install_alias
    install_alias()
import torch, deepspeed
with socket.socket() as probe:
    probe.bind(("127.0.0.1", 0))
    port = str(probe.getsockname()[1])
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                            torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)))
config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 1},
          "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
          "flops_profiler": {"enabled": True, "profile_step": 2, "top_modules": 2, "output_file": sys.argv[2]}}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
for _ in range(8):
    engine.backward(engine(torch.randn(2, 8)).sum())
    engine.step()
"""


def _run(python: str, flavour: str, report: Path) -> list[str]:
    ran = subprocess.run([python, "-c", SCRIPT, flavour, str(report)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert ran.returncode == 0, ran.stderr[-3000:]
    lines = []
    for line in report.read_text().splitlines():  # the timings are this run's own; the rest must be DeepSpeed's
        if line.lstrip().startswith("fwd latency - "):  # the modules ranked by this run's latencies
            lines.append("fwd latency -")
            continue
        if "latency" in line and "%" not in line or "FLOPS per GPU" in line or line.startswith("samples/second"):
            lines.append(line.split(":")[0])
            continue
        lines.append(re.sub(r"[\d.e+]+ [TGMKmu]?s = [\d.]+% latency, [\d.e+]+ [TGMKmu]?FLOPS", "<timing>", line))
    return lines


@needs_deepspeed
def test_the_same_profile_as_deepspeeds_engine(tmp_path):
    """Printed at the same micro-batches with the same lines, the timings aside; the forward
    flops differ by the ReLU's elements, which DeepSpeed counts and torch does not."""
    ours = _run(sys.executable, "shardwise", tmp_path / "ours.txt")
    theirs = _run(os.environ["DEEPSPEED_PYTHON"], "deepspeed", tmp_path / "theirs.txt")
    macs = 2 * (8 * 16 + 16 * 16 + 16 * 4)
    assert "Profile Summary at step 3:" in ours and _line("fwd MACs per GPU: ", f"{macs} MACs") in ours
    relu_elements = 2 * 16
    for label in ("fwd flops per GPU: ", "fwd flops of model = fwd flops per GPU * mp_size: "):
        assert _line(label, number_to_string(2 * macs)) in ours
        assert _line(label, number_to_string(2 * macs + relu_elements)) in theirs
    assert [line for line in ours if not line.startswith("fwd flops")] == [
        line for line in theirs if not line.startswith("fwd flops")]
