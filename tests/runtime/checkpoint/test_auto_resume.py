"""`auto_resume` (runtime/checkpoint/auto_resume.py) at the engine's start: nothing to
load is a fresh start, a checkpoint is loaded with its client_state, and ranks that see
different newest checkpoints stop together with each one named. The elastic restart
itself is tests/faults/test_elastic.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import shardwise
from shardwise.runtime.checkpoint.format import CheckpointError
from shardwise.tools.testing import run_distributed

CONFIG = {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "eps": 1e-4}},
          "zero_optimization": {"stage": 2}}


def engine_for(folder: str):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return shardwise.initialize(model, {**CONFIG, "auto_resume": {"checkpoint_dir": folder}})


def train_save_and_restart(rank: int, world_size: int, folder: str) -> tuple:
    engine = engine_for(folder)
    fresh = (engine.global_steps, engine.resumed_client_state)
    for _ in range(3):
        engine.backward(engine(torch.ones(2, 4)).sum())
        engine.step()
    engine.save_checkpoint(folder, tag="s3", client_state={"epoch": 7})
    weights = engine.module.weight.detach().clone()
    engine.destroy()
    restarted = engine_for(folder)
    resumed = (restarted.global_steps, restarted.resumed_client_state)
    return fresh, resumed, torch.equal(restarted.module.weight.detach(), weights)


def test_an_empty_folder_starts_fresh_and_a_checkpoint_is_resumed(tmp_path):
    fresh, resumed, same_weights = run_distributed(train_save_and_restart, 2, str(tmp_path))[0]
    assert fresh == (0, None)
    assert resumed == (3, {"epoch": 7})
    assert same_weights


def different_folders(rank: int, world_size: int, root: str) -> str:
    """The same relative folder from another working directory on each rank: what ranks
    on nodes without a shared filesystem see."""
    here = Path(root) / f"node{rank}"
    here.mkdir()
    os.chdir(here)
    if rank == 1:
        Path("ckpt/s1").mkdir(parents=True)
        Path("ckpt/latest").write_text("s1\n")
    with pytest.raises(CheckpointError) as error:
        engine_for("ckpt")
    return str(error.value)


def test_ranks_that_see_different_checkpoints_stop_together(tmp_path):
    for message in run_distributed(different_folders, 2, str(tmp_path)):
        assert "the ranks see different checkpoints (rank 0: no checkpoint, rank 1: s1)" in message
