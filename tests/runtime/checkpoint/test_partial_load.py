"""Loading only the weights of a checkpoint (DeepSpeed's `load_optimizer_states=False` and
`load_module_only=True`): the weights come back; the optimizer state this engine built
stays; `module_only` also keeps the schedule and the step counters."""

import json

import pytest
import torch

import shardwise
from shardwise.runtime.checkpoint.format import CheckpointError
from tests.runtime.zero.workers import build_model, global_batch, model_loss

CONFIG = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}}


def train_step(engine, step: int) -> None:
    x, y = global_batch(step, 2)
    engine.backward(model_loss(engine, "gpt", x, y))
    engine.step()


def snapshot(engine) -> tuple[dict, list]:
    weights = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
    state = [value.clone() for per_param in engine.optimizer.optimizer.state.values()
             for value in per_param.values() if torch.is_tensor(value)]
    return weights, state


def test_weights_only_loads_keep_the_optimizer_state(tmp_path):
    model = build_model("gpt")
    engine = shardwise.initialize(model, CONFIG)
    train_step(engine, 0)
    engine.save_checkpoint(tmp_path, tag="saved")
    saved_weights, saved_state = snapshot(engine)
    train_step(engine, 1)
    _, later_state = snapshot(engine)
    later_lr = engine.get_lr()
    assert not all(torch.equal(a, b) for a, b in zip(saved_state, later_state))

    for keyword, steps_after in (({"module_only": True}, 2), ({"optimizer_states": False}, 1)):
        engine.load_checkpoint(tmp_path, "saved", **keyword)
        weights, state = snapshot(engine)
        assert all(torch.equal(weights[name], saved_weights[name]) for name in saved_weights), keyword
        assert all(torch.equal(a, b) for a, b in zip(state, later_state)), keyword  # not the saved state
        assert engine.global_steps == steps_after, keyword
    assert engine.get_lr() != later_lr  # optimizer_states=False still restores the schedule
    engine.destroy()


def test_not_strict_loads_into_a_model_with_more_or_fewer_tensors(tmp_path):
    """`strict=False` (DeepSpeed's `load_module_strict=False`): shared tensors are loaded,
    the model's own extras keep their values, the checkpoint's extras are skipped; the
    optimizer state is only restored when every trained parameter is in the checkpoint."""
    from shardwise.runtime.checkpoint.format import CheckpointError

    plain = shardwise.initialize(build_model("gpt"), CONFIG)
    train_step(plain, 0)
    plain.save_checkpoint(tmp_path, tag="plain")
    plain_weights, plain_state = snapshot(plain)

    bigger_model = build_model("gpt")
    bigger_model.extra_head = torch.nn.Linear(3, 3)  # trained, absent from "plain"
    bigger = shardwise.initialize(bigger_model, CONFIG)
    train_step(bigger, 1)
    head_before = bigger.module.extra_head.weight.detach().clone()
    with pytest.raises(CheckpointError, match="extra_head.weight .* is not in checkpoint"):
        bigger.load_checkpoint(tmp_path, "plain")
    with pytest.raises(CheckpointError, match="lacks the model's trained parameter extra_head.bias.*load_optimizer_states=False"):
        bigger.load_checkpoint(tmp_path, "plain", strict=False)
    bigger.load_checkpoint(tmp_path, "plain", strict=False, optimizer_states=False)
    weights, _ = snapshot(bigger)
    assert all(torch.equal(weights[name], plain_weights[name]) for name in plain_weights)
    assert torch.equal(weights["extra_head.weight"], head_before)
    bigger.save_checkpoint(tmp_path, tag="bigger")
    bigger_weights, _ = snapshot(bigger)
    bigger.destroy()

    with pytest.raises(CheckpointError, match="holds extra_head"):
        plain.load_checkpoint(tmp_path, "bigger")
    plain.load_checkpoint(tmp_path, "bigger", strict=False)  # a superset: weights and state
    weights, state = snapshot(plain)
    assert all(torch.equal(weights[name], bigger_weights[name]) for name in plain_weights)
    assert len(state) == len(plain_state)
    plain.destroy()


@pytest.mark.parametrize("stage", [1, 3])
def test_a_checkpoint_without_frozen_parameters_resumes_with_strict_false(tmp_path, stage):
    """`exclude_frozen_parameters` (DeepSpeed's; the Hugging Face Trainer's for PEFT): the
    frozen parameters (whole at stage 1, partitioned at stage 3) are not written; a strict
    load says how to load it; `strict=False` restores the trained ones and their optimizer
    state, and the frozen ones keep the model's values."""
    model = build_model("gpt")
    frozen = [name for name, param in model.named_parameters() if param.dim() == 2][:2]
    for name in frozen:
        model.get_parameter(name).requires_grad_(False)
    config = {**CONFIG, "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    engine = shardwise.initialize(model, config)
    try:
        train_step(engine, 0)
        engine.save_checkpoint(tmp_path, tag="saved", exclude_frozen_parameters=True)
        with shardwise.gathered_parameters(list(model.parameters())):
            saved = {name: p.detach().clone() for name, p in model.named_parameters()}
        listed = {entry["name"] for entry in json.loads((tmp_path / "saved" / "meta.json").read_text())["parameters"]}
        assert listed and not listed & set(frozen)
        train_step(engine, 1)
        with pytest.raises(CheckpointError, match="exclude_frozen_parameters=True.*strict=False"):
            engine.load_checkpoint(tmp_path, "saved")
        engine.load_checkpoint(tmp_path, "saved", strict=False)
        with shardwise.gathered_parameters(list(model.parameters())):
            for name, param in model.named_parameters():
                assert torch.equal(param, saved[name]), name  # trained: restored; frozen: never changed
        train_step(engine, 1)
    finally:
        engine.destroy()
