"""DeepSpeed's files are pickles: read with weights_only and an allow-list of exactly the types
DeepSpeed writes, so a file naming any other callable is refused (naming the file, the type
and the opt-in) before anything in it runs."""

import argparse
import os
import shutil

import pytest
import torch

from shardwise.frontends.deepspeed.checkpoints.pickles import (
    DynamicLossScaler,
    ZeroStageEnum,
    load_pickle,
    save_pickle,
)
from shardwise.frontends.deepspeed.checkpoints.reader import read_deepspeed_checkpoint
from shardwise.runtime.checkpoint.format import CheckpointError
from tests.frontends.deepspeed.checkpoints.workers import FIXTURES


class MakesADirectory:
    """What a hostile file holds: unpickling it calls os.mkdir."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return os.mkdir, (self.path,)


def test_a_file_holding_another_callable_is_refused_before_it_runs(tmp_path):
    folder = tmp_path / "step3"
    shutil.copytree(FIXTURES / "stage2_fp32" / "checkpoint" / "step3", folder)
    model_file = folder / "mp_rank_00_model_states.pt"
    saved = load_pickle(model_file)
    marker = tmp_path / "ran"
    torch.save({**saved, "payload": MakesADirectory(str(marker))}, tmp_path / "hostile.pt")
    os.replace(tmp_path / "hostile.pt", model_file)  # not over the file `saved` is memory-mapped from
    with pytest.raises(CheckpointError) as refusal:
        read_deepspeed_checkpoint(folder)
    message = str(refusal.value)
    assert str(model_file) in message  # the file
    assert "mkdir" in message  # the type found
    assert "trusted=True" in message and "--trust-pickles" in message  # how to proceed for a trusted file
    assert not marker.exists()  # nothing in the file ran


def test_a_trusted_file_with_other_types_is_read_on_opt_in(tmp_path):
    """A Megatron-DeepSpeed script pickles its argparse.Namespace into the client state:
    refused by default, read (by torch's unrestricted load) when the user opts in."""
    folder = tmp_path / "step3"
    shutil.copytree(FIXTURES / "stage2_fp32" / "checkpoint" / "step3", folder)
    model_file = folder / "mp_rank_00_model_states.pt"
    torch.save({**load_pickle(model_file), "args": argparse.Namespace(seq_length=8)}, tmp_path / "with_args.pt")
    os.replace(tmp_path / "with_args.pt", model_file)
    with pytest.raises(CheckpointError, match=r"argparse.Namespace.*SHARDWISE_TRUST_PICKLES=1"):
        read_deepspeed_checkpoint(folder)
    contents = read_deepspeed_checkpoint(folder, trusted=True)
    assert contents.client_state["args"].seq_length == 8 and contents.global_steps == 3


def test_deepspeeds_own_types_load_as_inert_stand_ins(tmp_path):
    """The loss scaler and ZeRO stage DeepSpeed pickles, written under DeepSpeed's class names
    (as DeepSpeed reads them back) and read again through the allow-list."""
    scaler = DynamicLossScaler(cur_scale=1024.0, cur_iter=7, last_overflow_iter=2, dynamic=True)
    save_pickle({"loss_scaler": scaler, "zero_stage": ZeroStageEnum.gradients}, tmp_path / "state.pt")
    raw = (tmp_path / "state.pt").read_bytes()
    assert b"deepspeed.runtime.fp16.loss_scaler" in raw and b"DynamicLossScaler" in raw
    assert b"shardwise" not in raw.replace(b"shardwise_deepspeed_pickle", b"")
    loaded = load_pickle(tmp_path / "state.pt")
    assert isinstance(loaded["loss_scaler"], DynamicLossScaler) and vars(loaded["loss_scaler"]) == vars(scaler)
    assert loaded["zero_stage"] == 2
