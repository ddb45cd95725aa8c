"""A checkpoint shared by the fault and export tests: 2 ranks, ZeRO-3 with every
parameter partitioned, so each parameter is stored in pieces across two rank files."""

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from shardwise.tools.testing import run_distributed
from tests.runtime.checkpoint.workers import PARTITION_EVERYTHING, Run, train_run
from tests.runtime.zero.workers import Case


@dataclass(frozen=True)
class SavedCheckpoint:
    directory: Path
    tag: str
    params: dict[str, torch.Tensor]  # the trained model's full weights, gathered


@pytest.fixture(scope="session")
def stage3_checkpoint(tmp_path_factory) -> SavedCheckpoint:
    directory = tmp_path_factory.mktemp("stage3-checkpoint")
    run = Run(Case(stage=3, extra_config=PARTITION_EVERYTHING), save_dir=str(directory))
    result = run_distributed(train_run, 2, run)[0]
    return SavedCheckpoint(directory, "global_step2", result["params"])
