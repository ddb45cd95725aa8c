"""A config's `optimizer.type` / `scheduler.type` naming a `torch.optim` optimizer or a
`torch.optim.lr_scheduler` schedule that DeepSpeed does not define itself: DeepSpeed 0.19.8
builds the torch class by its exact name with `params` as given
(shardwise/runtime/optim/torch_by_name.py), and so does shardwise, stepping it on ZeRO's
shards. Under ZeRO on 2 ranks the training equals torch's class on one process over the
global batch; with DEEPSPEED_PYTHON set, DeepSpeed itself trains the same configs to the
same losses and learning rates."""

import json
import os
import sys

import pytest
import torch
from torch import nn

from shardwise.frontends.deepspeed.config import ConfigError, load_config
from shardwise.tools.testing import run_distributed
from tests.frontends.deepspeed.deepspeed_side import ONE_RANK, deepspeed_json

STEPS = 4
ROWS = 2  # per rank and step
OPTIMIZER = {"type": "RMSprop", "params": {"lr": 0.01, "alpha": 0.9, "momentum": 0.5, "centered": True}}
SCHEDULER = {"type": "StepLR", "params": {"step_size": 2, "gamma": 0.5}}


def _model() -> nn.Module:
    """The same weights on every rank (ranks are threads: torch's global seed is shared)."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) / 2)
    return model


def _batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(rows, 4, generator=generator), torch.randn(rows, 1, generator=generator)


def _train_sharded(rank: int, world_size: int, config: dict) -> dict:
    import shardwise.frontends.deepspeed.api as deepspeed

    model = _model()
    engine, optimizer, _, scheduler = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                           config=config)
    lrs = []
    for step in range(STEPS):
        x, y = _batch(step, ROWS * world_size)
        lrs.append(scheduler.get_last_lr()[0])
        loss = nn.functional.mse_loss(engine(x[rank * ROWS:(rank + 1) * ROWS]), y[rank * ROWS:(rank + 1) * ROWS])
        engine.backward(loss)
        engine.step()
    return {"lrs": lrs, "optimizer": type(optimizer).__name__,
            "params": [parameter.detach().clone() for parameter in engine.module.parameters()]}


def _train_on_one_process(world_size: int) -> dict:
    model = _model()
    optimizer = torch.optim.RMSprop(model.parameters(), **OPTIMIZER["params"])
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, **SCHEDULER["params"])
    lrs = []
    for step in range(STEPS):
        x, y = _batch(step, ROWS * world_size)
        lrs.append(scheduler.get_last_lr()[0])
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        scheduler.step()
    return {"lrs": lrs, "params": [parameter.detach() for parameter in model.parameters()]}


def test_a_torch_optimizer_and_schedule_by_name_train_under_zero_as_on_one_process():
    config = {"train_micro_batch_size_per_gpu": ROWS, "zero_optimization": {"stage": 2}, "gradient_clipping": 0.0,
              "optimizer": OPTIMIZER, "scheduler": SCHEDULER}  # deepspeed.initialize clips at 1.0 by default
    result = run_distributed(_train_sharded, 2, config, timeout=120)[0]
    reference = _train_on_one_process(2)
    assert result["optimizer"] == "RMSprop"  # the torch class itself, as DeepSpeed builds it
    assert result["lrs"] == reference["lrs"] == [0.01, 0.01, 0.005, 0.005]
    for got, expected in zip(result["params"], reference["params"]):
        assert ((got - expected).norm() / expected.norm()).item() < 1e-5


def _resume(rank: int, world_size: int, tmp: str) -> dict:
    """Four steps uninterrupted; two, a checkpoint, and two of a fresh engine that loads it."""
    import shardwise.frontends.deepspeed.api as deepspeed

    config = {"train_micro_batch_size_per_gpu": ROWS, "zero_optimization": {"stage": 2},
              "optimizer": OPTIMIZER, "scheduler": SCHEDULER}

    def engine() -> object:
        model = _model()
        return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)[0]

    def train(trained: object, steps: range) -> list[float]:
        losses = []
        for step in steps:
            x, y = _batch(step, ROWS * world_size)
            loss = nn.functional.mse_loss(trained(x[rank * ROWS:(rank + 1) * ROWS]), y[rank * ROWS:(rank + 1) * ROWS])
            trained.backward(loss)
            trained.step()
            losses.append(loss.item())
        return losses

    uninterrupted = train(engine(), range(STEPS))
    first = engine()
    train(first, range(2))
    first.save_checkpoint(tmp)
    resumed = engine()
    resumed.load_checkpoint(tmp)
    return {"uninterrupted": uninterrupted[2:], "resumed": train(resumed, range(2, STEPS)),
            "lr": resumed.get_lr()[0]}


def test_a_checkpoint_resumes_the_torch_optimizer_and_schedule_exactly(tmp_path):
    result = run_distributed(_resume, 2, str(tmp_path), timeout=120)[0]
    assert result["resumed"] == result["uninterrupted"]
    assert result["lr"] == 0.0025  # StepLR halved twice in four steps


@pytest.mark.parametrize(("block", "type_name", "params", "words"), [
    ("optimizer", "LBFGS", {}, "missing 1 required positional argument: 'closure'"),
    ("optimizer", "SparseAdam", {}, "SparseAdam does not support dense gradients"),
    ("optimizer", "RMSprop", {"lr": 0.01, "alpha": -1.0}, "Invalid alpha value: -1.0"),
    ("scheduler", "ReduceLROnPlateau", {}, "missing 1 required positional argument: 'metrics'"),
])
def test_what_cannot_train_as_deepspeed_steps_it_is_refused_with_torchs_reason(block, type_name, params, words):
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              block: {"type": type_name, "params": params}}
    with pytest.raises(ConfigError) as refused:
        load_config(config, world_size=1)
    assert f"{block}.params: torch.optim." in str(refused.value) and words in str(refused.value)
    assert "DeepSpeed 0.19.8 fails on them too" in str(refused.value)


@pytest.mark.parametrize(("block", "given", "expected"), [
    ("optimizer", "rmsprop", "optimizer.type 'rmsprop' is unknown; did you mean 'RMSprop'?"),
    ("scheduler", "steplr", "scheduler.type 'steplr' is unknown; did you mean 'StepLR'?"),
])
def test_torch_names_are_matched_in_their_exact_case_as_deepspeed_does(block, given, expected):
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              block: {"type": given, "params": {}}}
    with pytest.raises(ConfigError, match=expected):
        load_config(config, world_size=1)


def test_a_schedule_needing_a_callable_names_the_missing_argument():
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "scheduler": {"type": "LambdaLR", "params": {}}}
    with pytest.raises(ConfigError, match="scheduler.params.lr_lambda: required key is missing"):
        load_config(config, world_size=1)


def test_the_memory_estimate_counts_the_optimizers_own_state():
    """K from the state the class keeps: RMSprop centered with momentum keeps three
    tensors (square_avg, momentum_buffer, grad_avg), Adamax two, plain RMSprop one."""
    from shardwise.runtime.optim.registry import optimizer_spec

    def states(type_name: str, params: dict) -> float:
        config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": type_name, "params": params}}
        cfg = load_config(config, world_size=1)
        return optimizer_spec(type_name).fp32_states(cfg.optimizer.params)

    assert states("RMSprop", OPTIMIZER["params"]) == 3
    assert states("Adamax", {"lr": 0.01}) == 2
    assert states("RMSprop", {"lr": 0.01}) == 1


# The same script under DeepSpeed 0.19.8 and shardwise: the module to import is argv[1].
BOTH_SIDES = """
import json, os, socket, sys, importlib, torch
from torch import nn
deepspeed = importlib.import_module(sys.argv[1])
configs = json.loads(sys.argv[2])
""" + ONE_RANK + """
deepspeed.init_distributed("gloo")
results = {}
for name, config in configs.items():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    engine, _, _, scheduler = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    losses, lrs = [], []
    for step in range(5):
        generator = torch.Generator().manual_seed(100 + step)
        x, y = torch.randn(2, 4, generator=generator), torch.randn(2, 1, generator=generator)
        lrs.append(engine.get_lr()[0])
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    results[name] = {"losses": losses, "lrs": lrs}
print(json.dumps(results))
"""


def _deepspeed_configs() -> dict[str, dict]:
    def config(optimizer: str, params: dict, stage: int = 0, scheduler: dict | None = None) -> dict:
        return {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
                "zero_allow_untested_optimizer": True, "optimizer": {"type": optimizer, "params": params},
                **({"scheduler": scheduler} if scheduler else {})}

    configs = {name: config(name, {"lr": 0.01}) for name in ("RMSprop", "Adamax", "NAdam", "RAdam", "ASGD",
                                                              "Adadelta", "Rprop")}
    configs["RMSprop_centered_at_stage_2"] = config("RMSprop", OPTIMIZER["params"], stage=2)
    configs["Adamax_at_stage_1"] = config("Adamax", {"lr": 0.01, "weight_decay": 0.1}, stage=1)
    for schedule, params in (("StepLR", {"step_size": 2, "gamma": 0.5}), ("CosineAnnealingLR", {"T_max": 4}),
                             ("ExponentialLR", {"gamma": 0.9}), ("LinearLR", {"total_iters": 3}),
                             ("MultiStepLR", {"milestones": [1, 3]}), ("CyclicLR", {"base_lr": 0.001, "max_lr": 0.1,
                                                                                     "step_size_up": 2})):
        configs[f"SGD_with_{schedule}"] = config("SGD", {"lr": 0.1, "momentum": 0.9}, scheduler={
            "type": schedule, "params": params})
    return configs


@pytest.mark.skipif(not os.environ.get("DEEPSPEED_PYTHON"), reason="set DEEPSPEED_PYTHON to an interpreter with "
                    "DeepSpeed 0.19.8 to compare with it")
def test_deepspeed_trains_them_to_the_same_losses_and_rates():
    configs = json.dumps(_deepspeed_configs())
    sides = {}
    for module, python in (("deepspeed", os.environ["DEEPSPEED_PYTHON"]),
                           ("shardwise.frontends.deepspeed.api", sys.executable)):
        sides[module] = deepspeed_json(BOTH_SIDES, module, configs, python=python)
    deepspeed, shardwise = sides["deepspeed"], sides["shardwise.frontends.deepspeed.api"]
    assert set(deepspeed) == set(shardwise) == set(json.loads(configs))
    for name in deepspeed:
        assert shardwise[name]["lrs"] == pytest.approx(deepspeed[name]["lrs"], rel=1e-12), name
        assert shardwise[name]["losses"] == pytest.approx(deepspeed[name]["losses"], rel=1e-5), name

