"""`runtime.bf16_optimizer.BF16_Optimizer`, `runtime.fp16.fused_optimizer.FP16_Optimizer`
and `runtime.fp16.unfused_optimizer.FP16_UnfusedOptimizer`: the optimizer `initialize`
returns (and `engine.optimizer`) is an instance of exactly the wrapper class DeepSpeed
0.19.8's engine builds for the config, the optimizer passed in and the model (a pipeline
or not); compared with DeepSpeed itself when DEEPSPEED_PYTHON names an interpreter with it.

DeepSpeed refuses fp16 on a CPU, so its fp16 cases are read from its source: stage 0 in
fp16 takes the branch of `_configure_fp16_optimizer` that bf16 outside a pipeline takes."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

import shardwise.frontends.deepspeed.api as deepspeed
from shardwise.frontends.deepspeed.api.ops.adam import FusedAdam
from shardwise.frontends.deepspeed.api.pipe import PipelineModule
from shardwise.frontends.deepspeed.api.runtime.bf16_optimizer import BF16_Optimizer
from shardwise.frontends.deepspeed.api.runtime.fp16.fused_optimizer import FP16_Optimizer
from shardwise.frontends.deepspeed.api.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
from shardwise.frontends.deepspeed.api.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from shardwise.frontends.deepspeed.api.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from shardwise.tools.testing import run_distributed
from tests.frontends.deepspeed.deepspeed_side import ONE_RANK, deepspeed_json

WRAPPERS = (BF16_Optimizer, FP16_Optimizer, FP16_UnfusedOptimizer, DeepSpeedZeroOptimizer,
            DeepSpeedZeroOptimizer_Stage3)


def _config(stage: int, precision: str | None, optimizer: str | None = "Adam", *, grad_accum: str | None = None,
            offload: bool = False, **params: object) -> dict:
    config: dict = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage}}
    if optimizer is not None:
        config["optimizer"] = {"type": optimizer, "params": {"lr": 1e-3, **params}}
    if precision is not None:
        config[precision] = {"enabled": True}
    if grad_accum is not None:
        config["data_types"] = {"grad_accum_dtype": grad_accum}
    if offload:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    return config


# (config, the optimizer the script passes: None, "torch" (torch.optim.Adam) or "fused"
# (deepspeed.ops.adam.FusedAdam), a PipelineModule?) -> the class of DeepSpeed's engine.optimizer
# (None: the torch optimizer itself), as DeepSpeed 0.19.8 on CPU answers
BF16_CASES = [
    ((_config(0, "bf16"), None, False), "FP16_Optimizer"),
    ((_config(0, "bf16", torch_adam=True), None, False), "FP16_UnfusedOptimizer"),
    ((_config(0, "bf16", "SGD"), None, False), "FP16_UnfusedOptimizer"),
    ((_config(0, "bf16", None), "torch", False), "FP16_UnfusedOptimizer"),
    ((_config(0, "bf16", None), "fused", False), "FP16_Optimizer"),
    ((_config(0, "bf16"), None, True), "BF16_Optimizer"),
    ((_config(1, "bf16"), None, True), "DeepSpeedZeroOptimizer"),
    ((_config(1, "bf16", grad_accum="fp32"), None, False), "BF16_Optimizer"),
    ((_config(1, "bf16", grad_accum="torch.float32"), None, False), "BF16_Optimizer"),  # DeepSpeed's other spellings
    ((_config(1, "bf16", grad_accum="fp32", offload=True), None, False), "DeepSpeedZeroOptimizer"),
    ((_config(2, "bf16", grad_accum="fp32"), None, False), "DeepSpeedZeroOptimizer"),
    ((_config(0, None), None, False), None),
]
# DeepSpeed's fp16 branch, read from its engine (a CPU cannot run it)
FP16_CASES = [
    ((_config(0, "fp16"), None, False), "FP16_Optimizer"),
    ((_config(0, "fp16", None), "torch", False), "FP16_UnfusedOptimizer"),
    ((_config(0, "fp16", None), "fused", False), "FP16_Optimizer"),
]


def _model(pipeline: bool) -> nn.Module:
    layers = [nn.Linear(4, 4), nn.Linear(4, 4)]
    return PipelineModule(layers=layers, num_stages=1, loss_fn=nn.MSELoss()) if pipeline else nn.Sequential(*layers)


def _client_optimizer(kind: str | None, model: nn.Module) -> torch.optim.Optimizer | None:
    if kind is None:
        return None
    return (torch.optim.Adam if kind == "torch" else FusedAdam)(model.parameters(), lr=1e-3)


def _wrapper_names(rank: int, world_size: int, cases: list) -> list[str | None]:
    names = []
    for config, client, pipeline in cases:
        model = _model(pipeline)
        engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                       optimizer=_client_optimizer(client, model), config=config)
        wrappers = [wrapper.__name__ for wrapper in WRAPPERS if isinstance(optimizer, wrapper)]
        assert wrappers == [wrapper.__name__ for wrapper in WRAPPERS if isinstance(engine.optimizer, wrapper)]
        assert len(wrappers) <= 1, wrappers  # one DeepSpeed class, as an object has one
        names.append(wrappers[0] if wrappers else None)
        engine.destroy()
    return names


def test_the_optimizer_is_the_wrapper_deepspeed_builds():
    cases = BF16_CASES + FP16_CASES
    assert run_distributed(_wrapper_names, 1, [case for case, _ in cases])[0] == [answer for _, answer in cases]


def test_the_wrapper_classes_derive_as_deepspeeds():
    assert issubclass(BF16_Optimizer, deepspeed.runtime.base_optimizer.ZeROOptimizer)
    for wrapper in (FP16_Optimizer, FP16_UnfusedOptimizer):
        assert issubclass(wrapper, deepspeed.runtime.base_optimizer.DeepSpeedOptimizer)
        assert not issubclass(wrapper, deepspeed.runtime.base_optimizer.ZeROOptimizer)


DEEPSPEED_WRAPPERS = """
import json, os, socket, sys, torch, deepspeed
from deepspeed.ops.adam import FusedAdam
from deepspeed.pipe import PipelineModule
""" + ONE_RANK + """
deepspeed.init_distributed()
names = []
for config, client, pipeline in json.loads(sys.argv[1]):
    layers = [torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)]
    model = (PipelineModule(layers=layers, num_stages=1, loss_fn=torch.nn.MSELoss()) if pipeline
             else torch.nn.Sequential(*layers))
    optimizer = None if client is None else (torch.optim.Adam if client == "torch" else FusedAdam)(
        model.parameters(), lr=1e-3)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), optimizer=optimizer,
                                           config=config)
    wrapped = engine.optimizer is not engine.basic_optimizer
    names.append(type(engine.optimizer).__name__ if wrapped else None)
print(json.dumps(names))
"""


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("DEEPSPEED_PYTHON"), reason="set DEEPSPEED_PYTHON to an interpreter with "
                    "DeepSpeed 0.19.8 to compare with it")
def test_deepspeed_builds_those_wrappers():
    assert deepspeed_json(DEEPSPEED_WRAPPERS, json.dumps([case for case, _ in BF16_CASES]), timeout=600) == [
        answer for _, answer in BF16_CASES]
