"""The Python front end: an engine from policies (no config) trains exactly as the same
settings written as a DeepSpeed config; a user's ModelPlan splits a model no family knows."""

import torch

import shardwise
from shardwise import (
    ActivationPolicy,
    ModelPlan,
    Policies,
    PrecisionPolicy,
    RecomputePolicy,
    TensorPolicy,
    TrainingPolicy,
    ZeroPolicy,
)
from shardwise.tools.testing import run_distributed
from tests.runtime.parallel.unit_workers import TwoLayers, two_layer_batch
from tests.runtime.zero.workers import build_model, global_batch, make_optimizer

STEPS = 3
CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 0.05,
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 3000},
    "activation_checkpointing": {"policy": "full"},
}
POLICIES = Policies(
    zero=ZeroPolicy(stage=3, reduce_bucket_size=3000, overlap_comm=True,
                    prefetch=shardwise.PrefetchPolicy(persistence_threshold=0)),
    precision=PrecisionPolicy(param_dtype=torch.bfloat16),
    training=TrainingPolicy(micro_batch_size=2, gradient_accumulation_steps=2, gradient_clipping=0.05),
    activation=ActivationPolicy(RecomputePolicy("full")),
)


def _train(rank: int, world_size: int, from_policies: bool) -> dict:
    model = build_model("gpt")
    optimizer = make_optimizer(model, 1e-2)
    if from_policies:
        engine = shardwise.build_engine(model, POLICIES, optimizer=optimizer)
    else:
        engine = shardwise.initialize(model, CONFIG, optimizer=optimizer)
    losses = []
    for step in range(STEPS):
        x, y = global_batch(step, 2 * 2 * world_size)
        for micro in range(2):
            rows = slice((micro * world_size + rank) * 2, (micro * world_size + rank + 1) * 2)
            loss = engine(x[rows], y[rows])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    with shardwise.gathered_parameters(list(model.parameters())):
        weights = {name: param.detach().float().clone() for name, param in model.named_parameters()}
    return {"losses": losses, "weights": weights, "stage": engine.stage,
            "bytes": engine.memory_breakdown(), "sent": engine.comm_volume()}


def test_policies_in_python_train_exactly_as_the_same_config():
    from_config = run_distributed(_train, 2, False)
    from_policies = run_distributed(_train, 2, True)
    for config_rank, policy_rank in zip(from_config, from_policies):
        assert policy_rank["losses"] == config_rank["losses"]
        assert policy_rank["bytes"] == config_rank["bytes"] and policy_rank["sent"] == config_rank["sent"]
        for name, weight in config_rank["weights"].items():
            assert torch.equal(policy_rank["weights"][name], weight), name


def _train_with_a_model_plan(rank: int, world_size: int, through_plan: bool) -> dict:
    model = TwoLayers()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    styles = {"fc1": "colwise", "fc2": "rowwise"}
    if through_plan:
        plan = ModelPlan(name="TwoLayers", tensor_styles=styles, divisible={"hidden width": 32})
        engine = shardwise.build_engine(model, Policies(tensor=TensorPolicy(size=2)), optimizer=optimizer, plan=plan)
    else:
        engine = shardwise.initialize(model, {"train_micro_batch_size_per_gpu": 8, "tensor_parallel":
                                              {"size": 2, "plan": styles}}, optimizer=optimizer)
    losses = []
    for step in range(STEPS):
        x, y = two_layer_batch(step)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"losses": losses, "fc1": engine.module.fc1.weight.detach().clone()}


def test_a_model_plan_splits_a_model_no_family_knows():
    """The same split as the config's tensor_parallel.plan, given as a ModelPlan; the
    single-process equivalence of that split is tests/runtime/parallel/test_tensor_parallel_parts.py's."""
    through_config = run_distributed(_train_with_a_model_plan, 2, False)
    through_plan = run_distributed(_train_with_a_model_plan, 2, True)
    for config_rank, plan_rank in zip(through_config, through_plan):
        assert plan_rank["losses"] == config_rank["losses"]
        assert plan_rank["fc1"].shape == (16, 16) and torch.equal(plan_rank["fc1"], config_rank["fc1"])
