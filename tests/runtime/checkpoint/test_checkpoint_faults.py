"""Crashes and bad input: a killed save leaves the previous checkpoint loadable; damaged
files, another model and unknown tags fail with errors that say what is wrong (issue 4)."""

import shutil
import signal

import pytest
import torch

import shardwise
from shardwise.runtime.checkpoint import CheckpointError
from shardwise.runtime.checkpoint.manifest import list_tags
from shardwise.models import GPT, GPTConfig
from shardwise.tools.testing import run_distributed
from shardwise.tools.testing.forkserver import preloaded_forkserver_context
from tests.runtime.checkpoint.interrupted_save import load_after_kill, save_then_freeze
from tests.runtime.checkpoint.workers import FrozenAndNormed, untrained_state
from tests.runtime.zero.workers import Case, build_model, make_optimizer

FREEZE_TIMEOUT_S = 60


@pytest.mark.parametrize("phase", ["tensor-file", "before-latest", "replacing-tag"])
def test_sigkill_during_save_leaves_previous_checkpoint_loadable(phase, tmp_path):
    context = preloaded_forkserver_context()
    reports, child_end = context.Pipe(duplex=False)
    process = context.Process(target=save_then_freeze, args=(str(tmp_path), phase, child_end))
    process.start()
    child_end.close()
    try:
        assert reports.poll(FREEZE_TIMEOUT_S), "the saving process did not save its first checkpoint"
        saved_weights = reports.recv()
        assert reports.poll(FREEZE_TIMEOUT_S), f"the saving process did not reach {phase!r}"
        assert reports.recv() == phase
        process.kill()
        process.join()
    finally:
        if process.is_alive():
            process.kill()
    assert process.exitcode == -signal.SIGKILL
    assert (tmp_path / "latest").read_text().strip() == "good"

    result = run_distributed(load_after_kill, 1, str(tmp_path))[0]
    assert result == {"client_state": {"saved": "first"}, "global_steps": 1, "weights": saved_weights}
    if phase == "before-latest":  # the second save was complete, only `latest` lagged
        assert list_tags(tmp_path) == ["good", "second"]


def single_rank_engine(model=None, stage=1):
    model = model if model is not None else build_model("gpt")
    return shardwise.initialize(model, Case(stage=stage).config(1), optimizer=make_optimizer(model, 1e-2))


@pytest.fixture
def checkpoint_copy(stage3_checkpoint, tmp_path):
    """A private copy of the shared checkpoint, free to damage."""
    directory = tmp_path / "checkpoint"
    shutil.copytree(stage3_checkpoint.directory, directory)
    return directory


def test_loads_pieces_written_by_two_ranks_into_one(stage3_checkpoint):
    engine = single_rank_engine()
    engine.load_checkpoint(stage3_checkpoint.directory)
    for name, param in engine.module.named_parameters():
        assert param.equal(stage3_checkpoint.params[name]), name


def test_truncated_file_is_named(checkpoint_copy):
    path = checkpoint_copy / "global_step2" / "rank_00001.safetensors"
    size = path.stat().st_size
    with open(path, "r+b") as handle:
        handle.truncate(size // 2)
    with pytest.raises(CheckpointError, match=rf"rank_00001.safetensors has {size // 2} bytes but the manifest records {size}"):
        single_rank_engine().load_checkpoint(checkpoint_copy)


def test_altered_file_is_named(checkpoint_copy):
    path = checkpoint_copy / "global_step2" / "rank_00000.safetensors"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit of one stored value
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"rank_00000.safetensors does not match its sha256"):
        single_rank_engine().load_checkpoint(checkpoint_copy)


def test_other_model_names_first_mismatched_parameter_and_both_shapes(stage3_checkpoint):
    torch.manual_seed(0)
    wider = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=48, bias=False))
    with pytest.raises(CheckpointError, match=r"wte.weight has shape \(64, 32\) in checkpoint .* but shape \(64, 48\)"):
        single_rank_engine(wider).load_checkpoint(stage3_checkpoint.directory)
    deeper = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=3, n_head=2, n_embd=32, bias=False))
    with pytest.raises(CheckpointError, match=r"blocks.2.ln_1.weight \(shape \(32,\)\) is not in checkpoint"):
        single_rank_engine(deeper).load_checkpoint(stage3_checkpoint.directory)


def test_missing_tag_lists_the_tags_present(checkpoint_copy):
    engine = single_rank_engine()
    with pytest.raises(CheckpointError, match=r"tag 'global_step9' .* does not exist; tags present: global_step2"):
        engine.load_checkpoint(checkpoint_copy, tag="global_step9")
    (checkpoint_copy / "latest").unlink()
    with pytest.raises(CheckpointError, match=r"no 'latest' file .* tags present: global_step2"):
        engine.load_checkpoint(checkpoint_copy)


def test_client_state_round_trip_and_non_json_rejected(tmp_path):
    engine = single_rank_engine()
    with pytest.raises(TypeError, match=r"client_state\['loader'\]\['cursor'\] is a Tensor"):
        engine.save_checkpoint(tmp_path, client_state={"loader": {"cursor": torch.tensor(3)}})
    with pytest.raises(TypeError, match=r"client_state has key 1 \(int\); JSON keys must be str"):
        engine.save_checkpoint(tmp_path, client_state={1: "a"})
    with pytest.raises(ValueError, match=r"invalid checkpoint tag '../elsewhere'"):
        engine.save_checkpoint(tmp_path, tag="../elsewhere")
    assert list(tmp_path.iterdir()) == []  # nothing was published

    state = {"epoch": 2, "metrics": {"loss": [1.5, 1.25]}, "note": None, "done": False}
    engine.save_checkpoint(tmp_path, tag="run", client_state={"old": True})
    assert engine.save_checkpoint(tmp_path, tag="run", client_state=state) == "run"  # replaces
    assert single_rank_engine().load_checkpoint(tmp_path) == state
    assert sorted(path.name for path in tmp_path.iterdir()) == ["latest", "run"]


@pytest.mark.parametrize("stage", [2, 3])
def test_frozen_parameters_and_buffers_are_restored(stage, tmp_path):
    saved = run_distributed(untrained_state, 2, stage, str(tmp_path), True)[0]
    loaded = untrained_state(0, 1, 1, str(tmp_path), save=False)
    assert saved["norm.num_batches_tracked"].item() == 2
    assert not saved["project.weight"].equal(FrozenAndNormed(seed=2).project.weight)
    assert saved.keys() == loaded.keys()
    for name, tensor in saved.items():
        assert loaded[name].equal(tensor), name
