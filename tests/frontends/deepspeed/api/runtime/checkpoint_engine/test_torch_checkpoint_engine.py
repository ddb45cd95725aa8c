"""`runtime.checkpoint_engine`: DeepSpeed's checkpoint engine interface and its torch.save
engine, on real files: a save reads back equal (in the format DeepSpeed's writes for the
config), a pickle naming other code is refused unless trusted, and DeepSpeed 0.19.8's
engine reads our files and ours read its (when DEEPSPEED_PYTHON names an interpreter with it)."""

from __future__ import annotations

import argparse
import json
import os
import pickle
import zipfile
from types import SimpleNamespace

import pytest
import torch

from shardwise.frontends.deepspeed.api.runtime.checkpoint_engine import (
    CheckpointCommitInfo,
    CheckpointEngine,
    TorchCheckpointEngine,
)
from tests.frontends.deepspeed.deepspeed_side import deepspeed_json


def _state() -> dict:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(3, 4, generator=generator, dtype=torch.float64)
    return {"module": {"weight": weight, "bias": torch.arange(3, dtype=torch.bfloat16)}, "global_steps": 7,
            "names": ["weight", "bias"]}


def _assert_same_state(loaded: dict, state: dict) -> None:
    assert loaded.keys() == state.keys() and loaded["global_steps"] == 7 and loaded["names"] == state["names"]
    for name, tensor in state["module"].items():
        assert loaded["module"][name].dtype == tensor.dtype
        assert torch.equal(loaded["module"][name], tensor)


@pytest.mark.parametrize("config, zip_format", [(None, False), ({}, True),
                                                ({"checkpoint_serialization": False}, False)])
def test_a_save_and_commit_reads_back_equal(tmp_path, config, zip_format):
    engine = TorchCheckpointEngine(None if config is None else SimpleNamespace(checkpoint_config=config))
    info = CheckpointCommitInfo(tag="global_step7", save_dir=str(tmp_path), save_latest=True)
    engine.create(info)
    folder = tmp_path / info.tag
    engine.makedirs(str(folder), exist_ok=True)
    engine.makedirs(str(folder), exist_ok=True)
    engine.save(_state(), str(folder / "mp_rank_00_model_states.pt"))
    assert engine.commit(info) is True
    path = folder / "mp_rank_00_model_states.pt"
    assert zipfile.is_zipfile(path) is zip_format  # DeepSpeed's format for the config
    _assert_same_state(engine.load(str(path)), _state())
    moved = engine.load(str(path), map_location=lambda storage, location: storage)
    _assert_same_state(moved, _state())
    assert engine.name == "TorchCheckpointEngine" and not engine.is_decoupled()
    assert engine.is_data_parallel_writer(0) and not engine.is_data_parallel_writer(1)


def test_a_pickle_naming_other_code_is_refused_unless_trusted(tmp_path, monkeypatch):
    monkeypatch.delenv("SHARDWISE_TRUST_PICKLES", raising=False)
    engine = TorchCheckpointEngine()
    path = str(tmp_path / "args.pt")
    engine.save({"args": argparse.Namespace(lr=0.1)}, path)
    with pytest.raises(pickle.UnpicklingError, match="SHARDWISE_TRUST_PICKLES=1"):
        engine.load(path)
    monkeypatch.setenv("SHARDWISE_TRUST_PICKLES", "1")
    assert engine.load(path)["args"].lr == 0.1


def test_the_interface_has_deepspeeds_defaults(tmp_path):
    with pytest.raises(TypeError, match="abstract"):
        CheckpointEngine()

    class Recording(CheckpointEngine):
        def __init__(self):
            super().__init__()
            self.calls = []

        def create(self, info):
            self.calls.append(("create", info.tag))

        def save(self, state_dict, path):
            self.calls.append(("save", path))

        def load(self, path, map_location=None):
            return path

        def commit(self, info):
            self.calls.append(("commit", info.tag))
            return True

    engine = Recording()
    with pytest.raises(FileExistsError):
        engine.makedirs(str(tmp_path))
    assert (engine.name, engine.is_decoupled(), engine.get_commit_info(), engine.preserves_storage_sharing()) == (
        None, False, None, True)
    engine.set_commit_info(CheckpointCommitInfo("t", str(tmp_path), False))
    engine.cleanup()
    assert engine.get_commit_info() is None


DEEPSPEED_ROUND_TRIP = """
import json, sys, torch
from types import SimpleNamespace
from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine
ours, theirs, config = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
engine = TorchCheckpointEngine(None if config is None else SimpleNamespace(checkpoint_config=config))
loaded = engine.load(ours)
engine.save({"module": {"weight": torch.arange(6, dtype=torch.float64).reshape(2, 3)}, "global_steps": 3}, theirs)
print(json.dumps({"weight": loaded["module"]["weight"].tolist(), "steps": loaded["global_steps"]}))
"""


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("DEEPSPEED_PYTHON"), reason="set DEEPSPEED_PYTHON to an interpreter with "
                    "DeepSpeed 0.19.8 to compare with it")
@pytest.mark.parametrize("config", [None, {"checkpoint_serialization": True}])
def test_deepspeeds_engine_reads_our_files_and_we_read_its(tmp_path, config):
    engine = TorchCheckpointEngine(None if config is None else SimpleNamespace(checkpoint_config=config))
    ours, theirs = tmp_path / "ours.pt", tmp_path / "theirs.pt"
    engine.save(_state(), str(ours))
    read = deepspeed_json(DEEPSPEED_ROUND_TRIP, str(ours), str(theirs), json.dumps(config), timeout=600)
    assert read == {"weight": _state()["module"]["weight"].tolist(), "steps": 7}
    assert zipfile.is_zipfile(theirs) is zipfile.is_zipfile(ours)  # the same format for the same config
    loaded = engine.load(str(theirs))
    assert loaded["global_steps"] == 3
    assert torch.equal(loaded["module"]["weight"], torch.arange(6, dtype=torch.float64).reshape(2, 3))
