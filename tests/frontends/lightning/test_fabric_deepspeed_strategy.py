"""Lightning Fabric's own DeepSpeedStrategy runs on shardwise under `shardwise run
--as-deepspeed` (C32): `fabric.save` writes the engine's checkpoint and `fabric.load`
restores it (Lightning's load_checkpoint imports deepspeed.runtime.base_optimizer and
sets `deepspeed.utils.logging.logger`'s level), after which training continues with the
same losses as the run that went on after the save (fp32, relative error < 1e-5), the
weights and the optimizer state both restored. `scripts/fabric_deepspeed_checkpoint.py`
says what the script does and which CUDA-only checks of the strategy it skips."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning", reason="the Lightning tests need the lightning extra: pip install 'shardwise[lightning]'")

SCRIPT = Path(__file__).resolve().parent / "scripts" / "fabric_deepspeed_checkpoint.py"


def test_fabric_save_and_load_continue_identically_at_zero_3(tmp_path):
    environment = {key: value for key, value in os.environ.items() if key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    environment["OMP_NUM_THREADS"] = "1"
    result = subprocess.run([sys.executable, "-m", "shardwise.tools.cli.main", "run", "--as-deepspeed",
                             "--no-local-rank", "--nproc", "2", str(SCRIPT), "--stage", "3", "--checkpoint",
                             str(tmp_path / "ckpt"), "--out", str(tmp_path / "run")],
                            capture_output=True, text=True, timeout=240, env=environment)
    assert result.returncode == 0, result.stderr[-6000:]
    for rank in range(2):
        run = json.loads((tmp_path / f"run.rank{rank}.json").read_text())
        assert run["step"] == 2  # the client state fabric.load put back
        assert len(run["resumed"]) == len(run["continued"]) == 3
        for step, (got, want) in enumerate(zip(run["resumed"], run["continued"])):
            assert abs(got - want) / abs(want) < 1e-5, f"rank {rank} step {step}: {got} vs {want}"
