"""`deepspeed.utils.zero_to_fp32` on shardwise checkpoints: the state dict a ZeRO-3 run on
2 ranks saved equals its gathered fp32 weights, under every tied name; the model loads it
back; the file and safetensors conversions write the same values."""

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import shardwise
from shardwise.frontends.deepspeed.api.utils.zero_to_fp32 import (
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
)
from shardwise.tools.testing import run_distributed
from tests.runtime.zero.workers import build_model, global_batch, model_loss


def train_and_save(rank: int, world_size: int, directory: str) -> dict:
    model = build_model("gpt")
    config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    engine = shardwise.initialize(model, config)
    for step in range(2):
        x, y = global_batch(step, 2 * world_size)
        loss = model_loss(engine, "gpt", x[rank * 2:(rank + 1) * 2], y[rank * 2:(rank + 1) * 2])
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(directory)
    masters = {owned.name: (owned.start, owned.master.detach().clone()) for owned in engine.zero.owned_ranges()}
    return masters


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = tmp_path_factory.mktemp("zero_to_fp32") / "checkpoints"
    pieces = run_distributed(train_and_save, 2, str(directory), timeout=240)
    return directory, pieces


def test_state_dict_holds_the_fp32_masters_under_every_name(saved):
    directory, pieces = saved
    state = get_fp32_state_dict_from_zero_checkpoint(directory)
    model = build_model("gpt")
    assert set(state) >= {name for name, _ in model.named_parameters()}
    assert "lm_head.weight" in state and state["lm_head.weight"] is state["wte.weight"]  # tied, as DeepSpeed gives it
    for rank_pieces in pieces:
        for name, (start, master) in rank_pieces.items():
            flat = state[name].reshape(-1)
            assert state[name].dtype == torch.float32
            assert torch.equal(flat[start:start + master.numel()], master.float()), name
    loaded = load_state_dict_from_zero_checkpoint(build_model("gpt"), directory)
    for name, param in loaded.named_parameters():
        assert torch.equal(param.detach(), state[name]), name


def test_conversions_write_the_same_weights(saved, tmp_path):
    directory, _ = saved
    state = get_fp32_state_dict_from_zero_checkpoint(directory, tag="global_step2")
    convert_zero_checkpoint_to_fp32_state_dict(directory, tmp_path / "bin")
    written = torch.load(tmp_path / "bin" / "pytorch_model.bin")
    assert written.keys() == state.keys() and all(torch.equal(written[k], state[k]) for k in state)
    convert_zero_checkpoint_to_fp32_state_dict(directory, tmp_path / "old_form.pt")  # DeepSpeed's output_file form
    assert torch.load(tmp_path / "old_form.pt").keys() == state.keys()
    convert_zero_checkpoint_to_fp32_state_dict(directory, tmp_path / "safe", safe_serialization=True)
    tensors = load_file(tmp_path / "safe" / "model.safetensors")
    for name, tensor in tensors.items():
        assert torch.equal(tensor, state[name]), name


def convert_on_every_rank(rank: int, world_size: int, directory: str, output: str) -> None:
    for _ in range(5):  # every rank writes the same file at once, as DeepSpeed's own test has them do
        torch.distributed.barrier()
        convert_zero_checkpoint_to_fp32_state_dict(directory, output)


def test_ranks_converting_to_the_same_path_at_once_do_not_collide(saved, tmp_path):
    directory, _ = saved
    run_distributed(convert_on_every_rank, 2, str(directory), str(tmp_path), timeout=240)
    written = torch.load(tmp_path / "pytorch_model.bin")
    assert written.keys() == get_fp32_state_dict_from_zero_checkpoint(directory).keys()
    assert [path.name for path in tmp_path.iterdir()] == ["pytorch_model.bin"]  # no temporary left


def save_with_deepspeed_api(rank: int, world_size: int, directory: str) -> None:
    import shardwise.frontends.deepspeed.api as deepspeed

    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    engine, *_ = deepspeed.initialize(model=build_model("gpt"), config=config)
    engine.save_checkpoint(directory, tag="step0")


def test_save_checkpoint_leaves_the_recovery_script_and_it_runs(tmp_path):
    directory = tmp_path / "checkpoints"
    run_distributed(save_with_deepspeed_api, 2, str(directory), timeout=240)
    script = directory / "zero_to_fp32.py"
    assert script.is_file()
    subprocess.run([sys.executable, str(script), str(directory), str(tmp_path / "out.bin"), "-t", "step0"],
                   check=True, capture_output=True, timeout=120)
    written = torch.load(tmp_path / "out.bin")
    assert all(torch.equal(written[k], v) for k, v in get_fp32_state_dict_from_zero_checkpoint(directory).items())
