"""DeepSpeed's `managed_gradient_accumulation: false`: every step() ends the window, the
caller decides how many backward passes it sums (the engine's side:
tests/runtime/engine/test_caller_ended_windows.py). Here: the key read into the policy,
DeepSpeed 0.19.8's refusals and shardwise's, the engine's `global_samples` counting the
micro-batches each window ran, and, with DEEPSPEED_PYTHON, DeepSpeed's own weights after
windows of 3, 1 and 2 micro-batches at every stage (fp32, relative error < 1e-5)."""

from __future__ import annotations

import pytest
import torch

from shardwise.frontends.deepspeed.config import ConfigError, load_config
from shardwise.frontends.deepspeed.config.policies import policies_from_config
from shardwise.tools.testing import run_distributed
from tests.frontends.deepspeed.deepspeed_side import deepspeed_trains, needs_deepspeed

WINDOWS = (3, 1, 2)


def _config(stage: int, **more: object) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
            "managed_gradient_accumulation": False, "zero_optimization": {"stage": stage},
            "zero_allow_untested_optimizer": True, **more}


def test_the_key_becomes_the_policy():
    assert policies_from_config(load_config(_config(2), world_size=1)).training.caller_ends_windows
    assert not policies_from_config(load_config({**_config(2), "managed_gradient_accumulation": True},
                                                world_size=1)).training.caller_ends_windows
    with pytest.raises(ConfigError, match="managed_gradient_accumulation"):
        load_config({**_config(2), "managed_gradient_accumulation": "no"}, world_size=1)


@pytest.mark.parametrize(("config", "words"), [
    (_config(1, zero_optimization={"stage": 1, "overlap_comm": True}), "overlap_comm true at stage 1"),
    (_config(0, pipeline_parallel={"size": 2}), "pipeline_parallel.size 2"),
    (_config(2, zero_optimization={"stage": 2, "zenflow": {"topk_ratio": 0.1}}), "ZenFlow"),
    (_config(0, compile={"deepcompile": True}), "not supported with DeepCompile"),
])
def test_what_ends_windows_on_its_own_count_is_refused(config, words):
    with pytest.raises(ConfigError, match=words):
        load_config(config, world_size=2)


# one rank's training, run by shardwise's `deepspeed` module and by DeepSpeed 0.19.8's alike
TRAIN = """
import torch
from torch import nn


def train(deepspeed, config, windows):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    samples, boundaries = [], []
    for step, window in enumerate(windows):
        for micro in range(window):
            generator = torch.Generator().manual_seed(100 * step + micro)
            x, y = torch.randn(2, 8, generator=generator), torch.randn(2, 8, generator=generator)
            boundaries.append(engine.is_gradient_accumulation_boundary())
            engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
        samples.append(engine.global_samples)
    weights = [p.detach().clone() for p in model.parameters()]
    if config["zero_optimization"]["stage"] == 3:
        gathered = deepspeed.zero.GatheredParameters(list(model.parameters()))
        with gathered:
            weights = [p.detach().clone() for p in model.parameters()]
    return {"weights": [w.flatten().tolist() for w in weights], "samples": samples, "boundaries": boundaries,
            "steps": engine.global_steps, "managed": engine.managed_gradient_accumulation()}
"""


def _shardwise_runs(rank: int, world_size: int, configs: dict[str, dict]) -> dict[str, dict]:
    import shardwise.frontends.deepspeed.api as deepspeed

    scope: dict = {}
    exec(TRAIN, scope)
    return {name: scope["train"](deepspeed, config, WINDOWS) for name, config in configs.items()}


CONFIGS = {f"stage_{stage}": _config(stage) for stage in (0, 1, 2, 3)}


def test_the_engine_counts_the_samples_each_window_ran():
    """DeepSpeed's engine adds train_batch_size / gradient_accumulation_steps samples per
    backward of the window (here 2 per backward on one rank); no backward is a boundary."""
    for run in run_distributed(_shardwise_runs, 1, {"stage_2": CONFIGS["stage_2"]})[0].values():
        assert run["samples"] == [6, 8, 12] and run["steps"] == 3
        assert not any(run["boundaries"]) and run["managed"] is False


@needs_deepspeed
def test_deepspeed_trains_the_same_windows_alike():
    ours = run_distributed(_shardwise_runs, 1, CONFIGS)[0]
    theirs = deepspeed_trains(TRAIN, CONFIGS, f"train(deepspeed, config, {list(WINDOWS)})")
    for name, run in ours.items():
        assert (run["samples"], run["boundaries"], run["steps"]) == (
            theirs[name]["samples"], theirs[name]["boundaries"], theirs[name]["steps"]), name
        for mine, reference in zip(run["weights"], theirs[name]["weights"]):
            mine, reference = torch.tensor(mine), torch.tensor(reference)
            assert ((mine - reference).norm() / reference.norm()).item() < 1e-5, name
