"""Launching a script as a DeepSpeed user runs it with accelerate, under `shardwise run
--as-deepspeed`, on a machine without GPUs: through scripts/gloo_for_nccl.py, since
accelerate (1.15) gives a DeepSpeed launch no process group there (with DeepSpeed itself too)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SHIM = Path(__file__).resolve().parent / "scripts" / "gloo_for_nccl.py"


def launch_as_deepspeed(script: Path, *args: str, nproc: int = 2, timeout: float = 300) -> None:
    """`script ARGS` on `nproc` ranks; fails with the end of its stderr if it exits non-zero."""
    environment = {key: value for key, value in os.environ.items()
                   if key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK") and not key.startswith("ACCELERATE_")}
    environment["OMP_NUM_THREADS"] = "1"
    command = [sys.executable, "-m", "shardwise.tools.cli.main", "run", "--as-deepspeed", "--no-local-rank",
               "--nproc", str(nproc), str(SHIM), str(script), *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=environment)
    assert result.returncode == 0, f"{script.name} exited with {result.returncode}:\n{result.stderr[-6000:]}"
