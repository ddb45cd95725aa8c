"""The engine's state_dict methods DeepSpeed scripts and integrations call, on 2 gloo ranks:
`_zero3_consolidated_16bit_state_dict()` (accelerate's `get_state_dict` and the Hugging
Face Trainer's `save_model` at ZeRO-3) gathers the whole model onto rank 0, a tied weight
one tensor under both names; `module_state_dict()` is the model's own state_dict, as
DeepSpeed's (ZeRO-3's placeholders included), without frozen parameters when asked; and
`set_train_micro_batch_size` changes the global batch as DeepSpeed 0.19.8's does."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardwise.frontends.deepspeed.api as deepspeed
from shardwise.tools.testing import run_distributed


class Tied(nn.Module):
    """An embedding and an output layer sharing one weight, a frozen layer and a buffer."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)
        self.out = nn.Linear(4, 8, bias=False)
        self.out.weight = self.embed.weight
        self.register_buffer("counts", torch.arange(3.0))

    def forward(self, tokens):
        return self.out(self.frozen(self.embed(tokens)) + self.counts.sum())


def _engine(stage: int):
    torch.manual_seed(0)
    model = Tied()
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config=config)
    return engine


def _whole_model() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return Tied().state_dict()


def _stage3(rank: int, world_size: int) -> dict:
    engine = _engine(3)
    try:
        engine.backward(engine(torch.tensor([[1, 2], [3, 4]])).square().mean())
        engine.step()  # the weights gathered are the trained ones, not the initial ones
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            trained = {name: param.detach().clone() for name, param in engine.module.named_parameters()}
        whole = engine._zero3_consolidated_16bit_state_dict()
        trainable = engine._consolidated_16bit_state_dict(exclude_frozen_parameters=True)
        placeholders = engine.module_state_dict(prefix="model.", exclude_frozen_parameters=True)
        answer = {"placeholders": {name: list(value.shape) for name, value in placeholders.items()}}
        if rank == 0:
            answer.update(keys=sorted(whole), trainable_keys=sorted(trainable),
                          tied_is_one_tensor=whole["embed.weight"] is whole["out.weight"],
                          trained_equal=all(torch.equal(whole[name], value) for name, value in trained.items()),
                          buffer=whole["counts"].tolist(), moved=not torch.equal(whole["embed.weight"],
                                                                                  _whole_model()["embed.weight"]))
        else:
            answer.update(whole=whole, trainable=trainable)
        return answer
    finally:
        engine.destroy()


def test_zero3_state_dict_is_gathered_onto_rank_0_with_a_tied_weight_shared():
    first, second = run_distributed(_stage3, 2)
    assert first["keys"] == sorted(_whole_model()) == ["counts", "embed.weight", "frozen.bias", "frozen.weight",
                                                         "out.weight"]
    assert first["trainable_keys"] == ["counts", "embed.weight", "out.weight"]
    assert first["tied_is_one_tensor"] and first["trained_equal"] and first["moved"]
    assert first["buffer"] == [0.0, 1.0, 2.0]
    assert (second["whole"], second["trainable"]) == (None, None)
    # DeepSpeed's module_state_dict at ZeRO-3: each parameter an empty placeholder on every rank
    assert first["placeholders"] == second["placeholders"] == {
        "model.embed.weight": [0], "model.out.weight": [0], "model.counts": [3]}


def _stage2(rank: int, world_size: int) -> dict:
    engine = _engine(2)
    try:
        refusals = []
        for call in (engine._zero3_consolidated_16bit_state_dict, engine._consolidated_16bit_state_dict):
            with pytest.raises(ValueError) as refused:
                call()
            refusals.append(str(refused.value))
        state = engine.module_state_dict()
        return {"refusals": refusals, "equal": all(torch.equal(state[name], value)
                                                   for name, value in _whole_model().items()),
                "keys": sorted(engine.module_state_dict(exclude_frozen_parameters=True))}
    finally:
        engine.destroy()


def test_below_zero3_the_module_state_dict_is_whole_and_consolidation_is_refused_as_deepspeed_does():
    for answer in run_distributed(_stage2, 2):
        assert answer["refusals"] == [
            "this function requires ZeRO-3 mode",
            "consolidated_16bit_state_dict is only applicable to cases where weights are partitioned, including "
            "Zero Stage 3 and tensor parallelism."]
        assert answer["equal"] and answer["keys"] == ["counts", "embed.weight", "out.weight"]


def test_set_train_micro_batch_size_keeps_the_accumulation_and_changes_the_global_batch():
    model = nn.Linear(2, 1)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    try:
        engine.set_train_micro_batch_size(3)
        assert (engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps(),
                engine.train_batch_size(), engine.tput_timer.batch_size) == (3, 2, 6, 6)
        for _ in range(2):
            engine.backward(engine(torch.ones(3, 2)).sum())
            engine.step()
        assert (engine.global_steps, engine.global_samples) == (1, 6)
        for wrong in (0, 1.5):
            with pytest.raises(ValueError, match="give a positive number of samples"):
                engine.set_train_micro_batch_size(wrong)
    finally:
        engine.destroy()
