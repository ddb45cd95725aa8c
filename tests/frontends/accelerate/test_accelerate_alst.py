"""Accelerate's ALST path (`ParallelismConfig(sp_backend="deepspeed")`, which calls
`register_with_transformers`, wraps the loader in `UlyssesSPDataLoaderAdapter` and passes
the mpu to `deepspeed.initialize` with a config that has no `sequence_parallel_size`)
under `shardwise run --as-deepspeed` on 2 ranks: the losses equal the whole sequences
trained in one process (fp32, relative < 1e-5). Measured: equal to the printed digits;
DeepSpeed 0.19.8 running the same script differs from the reference by up to 8e-6 relative
from step 2 on (its own arithmetic: the first loss is the same)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.frontends.accelerate.alst_reference import reference_losses

pytest.importorskip("accelerate", reason="the accelerate tests need the transformers extra")

SCRIPTS = Path(__file__).resolve().parent / "scripts"
ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_accelerate_alst_equals_whole_sequences(tmp_path):
    environment = {key: value for key, value in os.environ.items()
                   if key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK") and not key.startswith("ACCELERATE_")}
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": "auto",
                                  "gradient_accumulation_steps": 1}))
    environment.update(OMP_NUM_THREADS="1", ACCELERATE_USE_DEEPSPEED="true",
                       ACCELERATE_DEEPSPEED_CONFIG_FILE=str(config))
    command = [sys.executable, "-m", "shardwise.tools.cli.main", "run", "--as-deepspeed", "--no-local-rank",
               "--nproc", "2", str(SCRIPTS / "gloo_for_nccl.py"), str(SCRIPTS / "alst_accelerate.py"),
               str(tmp_path / "losses"), str(ROOT)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=240, env=environment)
    assert result.returncode == 0, result.stderr[-6000:]
    want = reference_losses()
    for rank in range(2):
        said = json.loads((tmp_path / f"losses.rank{rank}.json").read_text())
        assert said["length"] == 4  # two sequences per rank's loader, each trained by both ranks
        for got, expected in zip(said["losses"], want, strict=True):
            assert abs(got - expected) / expected < 1e-5, (said["losses"], want)
