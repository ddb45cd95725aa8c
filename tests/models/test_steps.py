"""A model's parallelisms run in the fixed order, before ZeRO takes the parameters
(shardwise/models/core/steps.py)."""

import pytest
import torch
from torch import nn

import shardwise
from shardwise.models.core import steps
from shardwise.models.gpt.parallelize import plan as gpt_plan
from shardwise.runtime.data.random_ltd import RandomLTDPolicy
from shardwise.runtime.engine.policies import Policies
from shardwise.runtime.parallel.pipeline.policy import PipelinePolicy
from shardwise.runtime.parallel.sequence.policy import SequencePolicy
from shardwise.runtime.parallel.tensor.policy import TensorPolicy
from tests.runtime.zero.workers import build_model, global_batch

ORDER = ["expert", "tensor", "sequence", "activation", "kernels and compile", "random-LTD", "pipeline"]
STEPS = {"tensor": "apply_tensor_step", "sequence": "apply_sequence_step", "expert": "apply_expert_step",
         "activation": "apply_activation_step", "kernels and compile": "apply_kernel_and_compile_step",
         "random-LTD": "apply_random_ltd_step", "pipeline": "apply_pipeline_step"}


def test_the_steps_run_in_the_documented_order(monkeypatch):
    seen = []
    for name, function in STEPS.items():
        monkeypatch.setattr(steps, function, lambda model, plan=None, name=name, **options: seen.append(name))
    model = build_model("gpt")
    shardwise.initialize(model, {"train_micro_batch_size_per_gpu": 2},
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert seen == ORDER


def test_zero_partitions_what_the_steps_made(monkeypatch):
    """A step that adds a parameter (as tensor parallelism replaces them): ZeRO trains it."""
    def add_a_gain(model: nn.Module, plan, **options) -> None:
        model.gain = nn.Parameter(torch.ones(()))
        forward = model.forward
        model.forward = lambda x, y: forward(x, y) * model.gain

    monkeypatch.setattr(steps, "apply_kernel_and_compile_step", add_a_gain)
    model = build_model("gpt")
    before = sum(p.numel() for p in model.parameters())
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine = shardwise.initialize(model, config)
    assert engine.num_parameters() == before + 1
    x, y = global_batch(0, 2)
    engine.backward(engine(x, y))
    engine.step()
    assert engine.module.gain.item() != 1.0  # trained through ZeRO like every other parameter


def test_a_step_its_policy_does_not_ask_for_does_nothing(monkeypatch):
    monkeypatch.setattr(steps, "split_pipeline", lambda *args, **kwargs: pytest.fail("should not run"))
    monkeypatch.setattr(steps, "apply_tensor_parallel", lambda *args, **kwargs: pytest.fail("should not run"))
    model = build_model("gpt")
    shardwise.initialize(model, {"train_micro_batch_size_per_gpu": 2},
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.parametrize(("policy", "named"), [
    (PipelinePolicy(size=2), "pipeline_parallel"),
    (SequencePolicy(size=2), "sequence_parallel"),
    (TensorPolicy(size=2, sequence_parallel=True), "tensor_parallel.sequence_parallel"),
])
def test_random_ltd_is_refused_where_a_rank_lacks_the_whole_sequence(policy, named):
    """The first dropping layer draws every layer's kept tokens over the whole sequence:
    a pipeline stage or a sequence shard does not have it."""
    random_ltd = RandomLTDPolicy(total_layer_num=2, layer_ids=(1,), min_value=4, max_value=16, require_steps=4,
                                 seq_per_step=4, global_batch_size=2)
    field = {PipelinePolicy: "pipeline", SequencePolicy: "sequence", TensorPolicy: "tensor"}[type(policy)]
    policies = Policies(random_ltd=random_ltd, **{field: policy})
    model = build_model("gpt")
    with pytest.raises(ValueError, match=f"random_ltd with {named}:"):
        steps.apply_random_ltd_step(model, gpt_plan(model), mesh=None, policies=policies)
