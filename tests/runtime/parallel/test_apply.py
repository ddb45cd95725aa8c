"""The apply stage runs model rewrites in the fixed order, before ZeRO takes the parameters."""

import importlib

import pytest
import torch
from torch import nn

import shardwise
from shardwise.runtime import apply as apply_stage
from shardwise.runtime.apply import ORDER, ModelTransform, register_transform
from tests.runtime.zero.workers import build_model, global_batch


@pytest.fixture
def transforms(monkeypatch):
    """An empty registry for the test: shardwise's own steps register when the engine is
    first imported, so import it before emptying the registry."""
    importlib.import_module("shardwise.runtime.engine")
    monkeypatch.setattr(apply_stage, "_TRANSFORMS", {})

    def add(name, apply, enabled=lambda config: True):
        register_transform(ModelTransform(name, enabled, apply))

    return add


def test_transforms_run_in_the_documented_order_whatever_the_registration_order(transforms):
    seen = []
    for name in reversed(ORDER):
        transforms(name, lambda model, config, mesh, name=name: seen.append(name) or model)
    model = build_model("gpt")
    shardwise.initialize(model, {"train_micro_batch_size_per_gpu": 2},
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert seen == list(ORDER)
    assert ORDER == ("tensor_parallel", "sequence_parallel", "activation_checkpointing", "compile", "pipeline")


def test_zero_partitions_the_transformed_model(transforms):
    class Scaled(nn.Module):  # a rewrite that adds a parameter, as tensor parallelism replaces them
        def __init__(self, inner):
            super().__init__()
            self.inner = inner
            self.gain = nn.Parameter(torch.ones(()))

        def forward(self, x, y):
            return self.inner(x, y) * self.gain

    transforms("compile", lambda model, config, mesh: Scaled(model))
    model = build_model("gpt")
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine = shardwise.initialize(model, config)
    assert isinstance(engine.module, Scaled)
    assert engine.num_parameters() == sum(p.numel() for p in model.parameters()) + 1
    x, y = global_batch(0, 2)
    engine.backward(engine(x, y))
    engine.step()
    assert engine.module.gain.item() != 1.0  # trained through ZeRO like every other parameter


def test_a_disabled_transform_is_skipped_and_unknown_slots_are_refused(transforms):
    transforms("pipeline", lambda model, config, mesh: pytest.fail("should not run"),
               enabled=lambda config: config.pipeline_parallel.size > 1)
    model = build_model("gpt")
    shardwise.initialize(model, {"train_micro_batch_size_per_gpu": 2},
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="unknown apply step 'quantize'"):
        register_transform(ModelTransform("quantize", lambda config: True, lambda m, c, mesh: m))
