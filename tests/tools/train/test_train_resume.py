"""`shardwise train --resume`: a run continued from a checkpoint of step k reads the batches
the uninterrupted run read (they are drawn from the step number and the seed alone), so at
the same number of ranks its losses equal the uninterrupted run's step for step, and at
another number of ranks (the same global batch) every step reads the same samples."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from shardwise.tools.data import BlockSampler

REPO_ROOT = Path(__file__).resolve().parents[3]
STEPS, SAVED = 6, 3


def shardwise_train(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardwise.tools.cli.main", "train", *flags],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=240)


def losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {record["step"]: record["loss"] for record in map(json.loads, lines)}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    out_dir = tmp_path_factory.mktemp("runs")
    result = shardwise_train("--model-size", "tiny", "--nproc", "2", "--steps", str(STEPS), "--save-every",
                             str(SAVED), "--out-dir", str(out_dir), "--name", "whole")
    assert result.returncode == 0, result.stdout + result.stderr
    return out_dir / "whole"


def resumed(uninterrupted: Path, nproc: int) -> Path:
    """A copy of the run, continued from its step-3 checkpoint on `nproc` ranks."""
    run_dir = uninterrupted.parent / f"resumed{nproc}"
    shutil.copytree(uninterrupted, run_dir)
    result = shardwise_train("--resume", f"step{SAVED}", "--nproc", str(nproc), "--out-dir",
                             str(run_dir.parent), "--name", run_dir.name)
    assert result.returncode == 0, result.stdout + result.stderr
    return run_dir


def relative_errors(a: dict[int, float], b: dict[int, float]) -> list[float]:
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    return [abs(a[step] - b[step]) / abs(b[step]) for step in range(1, STEPS + 1)]


def test_a_resumed_run_equals_the_uninterrupted_one_step_for_step(uninterrupted):
    assert max(relative_errors(losses(resumed(uninterrupted, 2)), losses(uninterrupted))) < 1e-6


@pytest.mark.slow
def test_a_run_resumed_on_one_rank_continues_the_same_training(uninterrupted):
    assert max(relative_errors(losses(resumed(uninterrupted, 1)), losses(uninterrupted))) < 1e-5


def test_every_step_reads_the_same_samples_at_any_number_of_ranks():
    """The data position is the step: at 1, 2 or 4 ranks the rows of a step are the same."""
    sampler = BlockSampler(np.arange(1000) % 251, seq_len=8, global_batch=8, seed=3)
    for step in range(STEPS):
        expected = sorted(sampler.global_offsets(step).tolist())
        for world_size in (1, 2, 4):
            rows = [sampler.global_offsets(step)[sampler.rank_rows(rank, world_size)] for rank in range(world_size)]
            assert sorted(np.concatenate(rows).tolist()) == expected


def test_resume_refuses_flags_that_would_change_the_run(uninterrupted):
    result = shardwise_train("--resume", "--stage", "1", "--out-dir", str(uninterrupted.parent), "--name",
                             uninterrupted.name)
    assert result.returncode == 2
    assert "--resume continues the run with its own settings" in result.stderr and "drop --stage" in result.stderr
