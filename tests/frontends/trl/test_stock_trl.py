"""TRL's SFT and DPO trainers as TRL ships them, their DeepSpeed config in `TrainingArguments
(deepspeed=...)`, run unchanged under `shardwise run --as-deepspeed` on 2 ranks at ZeRO-3
(scripts/stock_trl.py): every logged number equals TRL's own single-process run's (as in
test_trl.py).

At ZeRO-3, TRL's chunked log-probability kernel saves the LM head's weight and, in its
backward, reads the saved parameter's `ds_status` to gather it. Under any saved-tensor
hook torch hands a backward aliases, not the saved parameters, so `deepspeed.initialize`
counts no saved activations at stage 3 (ActivationPolicy.count_saved); with the hook on,
this backward raised an AttributeError.

The launches go through the accelerate tests' gloo_for_nccl.py: on a machine without
GPUs accelerate gives a DeepSpeed launch no process group (with DeepSpeed itself too)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl", reason="the TRL trainers need the trl extra: pip install 'shardwise[trl]'")

from shardwise.tools.testing import run_distributed  # noqa: E402
from tests.frontends.trl.test_trl import assert_logs_match  # noqa: E402
from tests.frontends.trl.workers import Run, train_reference  # noqa: E402

HERE = Path(__file__).resolve().parent
SHIM = HERE.parent / "accelerate" / "scripts" / "gloo_for_nccl.py"


def _stock(tmp_path: Path, kind: str, stage: int) -> dict:
    out = tmp_path / f"{kind}-{stage}"
    environment = {key: value for key, value in os.environ.items()
                   if key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK") and not key.startswith("ACCELERATE_")}
    environment["OMP_NUM_THREADS"] = "1"
    command = [sys.executable, "-m", "shardwise.tools.cli.main", "run", "--as-deepspeed", "--no-local-rank",
               "--nproc", "2", str(SHIM), str(HERE / "scripts" / "stock_trl.py"), kind, str(stage), str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=environment)
    assert result.returncode == 0, f"{kind} exited with {result.returncode}:\n{result.stderr[-6000:]}"
    return {int(step): entry for step, entry in json.loads((out / "logs.json").read_text()).items()}


@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_stock_trainer_at_zero3_logs_trls_numbers(tmp_path, kind):
    reference = run_distributed(train_reference, 1, Run(out_dir=str(tmp_path / "ref"), trainer=kind),
                                timeout=240)[0]
    assert_logs_match(_stock(tmp_path, kind, 3), reference["logs"])
