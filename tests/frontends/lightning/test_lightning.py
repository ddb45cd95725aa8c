"""Lightning's Trainer trains a LightningModule on shardwise as under its DDP strategy (C27).

`scripts/train_module.py` is launched on 2 CPU processes with `strategy="ddp"` (the
reference) and with `strategy="shardwise_stage_N"`: accumulation 2 with each epoch's
short last window, gradient clipping by norm, AdamW with weight decay, a StepLR stepped
by Lightning each epoch. Every rank's loss at every micro-batch is the same (fp32,
relative error < 1e-5); at stage 3 the run stops after epoch 1, saves through
`trainer.save_checkpoint` (the engine's checkpoint), and a new process resumes with
`fit(ckpt_path=...)` to the same epoch-2 losses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning", reason="ShardwiseStrategy needs the lightning extra: pip install 'shardwise[lightning]'")

SCRIPT = Path(__file__).resolve().parent / "scripts" / "train_module.py"
TOLERANCE = 1e-5


def _launch(tmp_path: Path, name: str, strategy: str, *args: str) -> list[list[float]]:
    environment = {key: value for key, value in os.environ.items() if key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    environment["OMP_NUM_THREADS"] = "1"
    prefix = tmp_path / name
    result = subprocess.run([sys.executable, "-m", "shardwise.tools.cli.main", "run", "--nproc", "2", str(SCRIPT),
                             "--strategy", strategy, "--losses", str(prefix), *args],
                            capture_output=True, text=True, timeout=240, env=environment)
    assert result.returncode == 0, f"{name} exited with {result.returncode}:\n{result.stderr[-6000:]}"
    return [json.loads(Path(f"{prefix}.rank{rank}.json").read_text()) for rank in range(2)]


def _assert_equal(run: list[list[float]], reference: list[list[float]]) -> None:
    for rank, (losses, expected) in enumerate(zip(run, reference)):
        assert len(losses) == len(expected) > 0, f"rank {rank}: {len(losses)} losses, reference {len(expected)}"
        for step, (value, want) in enumerate(zip(losses, expected)):
            error = abs(value - want) / abs(want)
            assert error < TOLERANCE, f"rank {rank} micro-batch {step}: {value} vs {want} ({error:.1e})"


@pytest.fixture(scope="module")
def ddp_losses(tmp_path_factory) -> list[list[float]]:
    return _launch(tmp_path_factory.mktemp("ddp"), "ddp", "ddp")


def test_stage_3_losses_equal_ddp_through_save_and_resume(tmp_path, ddp_losses):
    first = _launch(tmp_path, "first", "shardwise_stage_3", "--epochs", "1", "--save", str(tmp_path / "ckpt"))
    assert (tmp_path / "ckpt" / "checkpoint").is_dir() and (tmp_path / "ckpt" / "lightning_state.pt").is_file()
    resumed = _launch(tmp_path, "resumed", "shardwise_stage_3", "--epochs", "2", "--resume", str(tmp_path / "ckpt"))
    _assert_equal([a + b for a, b in zip(first, resumed)], ddp_losses)  # 5 micro-batches an epoch on each rank


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
def test_losses_equal_ddp(tmp_path, ddp_losses, stage):
    _assert_equal(_launch(tmp_path, f"stage{stage}", f"shardwise_stage_{stage}"), ddp_losses)


def test_version_check_says_what_to_install():
    from shardwise.frontends.lightning.versions import check_versions

    check_versions({"lightning": "2.6.6"})
    for installed in ({"lightning": "2.5.0"}, {"lightning": None}):
        with pytest.raises(ImportError, match=r"pip install 'shardwise\[lightning\]'"):
            check_versions(installed)
