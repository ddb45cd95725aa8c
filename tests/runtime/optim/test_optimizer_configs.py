"""The config blocks of LARS, Adafactor, 8-bit Adam and Muon: defaults are the classes'
(which follow their reference implementations), every param is validated, and K is the
planner's."""

import inspect

import pytest
import torch

from shardwise.frontends.deepspeed.config import ConfigError, load_config
from shardwise.runtime.optim.adafactor import Adafactor
from shardwise.runtime.optim.adam8bit import Adam8bit, AdamW8bit
from shardwise.runtime.optim.lars import Lars
from shardwise.runtime.optim.muon import Muon
from shardwise.runtime.optim.registry import optimizer_spec
from shardwise.tools.planner.optimizers import planned_state_bytes

CLASSES = {"Lars": Lars, "Adafactor": Adafactor, "Adam8bit": Adam8bit, "AdamW8bit": AdamW8bit, "Muon": Muon}


def _resolved(optimizer: dict) -> dict:
    return dict(load_config({"train_batch_size": 2, "optimizer": optimizer}, world_size=1).optimizer.params)


@pytest.mark.parametrize("type_name", list(CLASSES))
def test_config_defaults_are_the_constructor_defaults(type_name):
    parameters = inspect.signature(CLASSES[type_name]).parameters.items()
    defaults = {name: parameter.default for name, parameter in parameters
                if parameter.default is not inspect.Parameter.empty and name != "use_muon"}  # per param group
    assert _resolved({"type": type_name.lower()}) == defaults  # type names match case-insensitively


@pytest.mark.parametrize(("ours", "theirs", "renamed"), [
    (Adafactor, torch.optim.Adafactor, {}),
    (Muon, torch.optim.Muon, {"eps": "ns_eps"}),
])
def test_defaults_follow_torch(ours, theirs, renamed):
    mine = inspect.signature(ours).parameters
    for name, parameter in inspect.signature(theirs).parameters.items():
        if parameter.default is not inspect.Parameter.empty and name not in ("foreach",):
            assert mine[renamed.get(name, name)].default == parameter.default, name


@pytest.mark.parametrize(("optimizer", "problem"), [
    ({"type": "Adafactor", "params": {"d": 0.5}}, "optimizer.params.d: Input should be greater than or equal to 1"),
    ({"type": "Adafactor", "params": {"eps": [None, -1]}}, "optimizer.params.eps: eps [None, -1.0]: epsilon1 must be null or >= 0"),
    ({"type": "Adafactor", "params": {"beta2_decay": 0.5}}, "optimizer.params.beta2_decay: Input should be less"),
    ({"type": "Lars", "params": {"nesterov": True}}, "optimizer.params: nesterov needs momentum > 0"),
    ({"type": "Lars", "params": {"trust_coeff": 0.1}}, "unknown key 'optimizer.params.trust_coeff'; did you mean"),
    ({"type": "Adam8bit", "params": {"betas": [0.9, 1.0]}}, "optimizer.params.betas: betas [0.9, 1.0] must"),
    ({"type": "AdamW8bit", "params": {"min_8bit_size": -1}}, "optimizer.params.min_8bit_size: Input should be"),
    ({"type": "Muon", "params": {"ns_steps": 100}}, "optimizer.params.ns_steps: Input should be less than 100"),
    ({"type": "Muon", "params": {"adjust_lr_fn": "rms"}}, "optimizer.params.adjust_lr_fn: Input should be"),
    ({"type": "Muon", "params": {"ns_dtype": "float16"}}, "optimizer.params.ns_dtype: Input should be"),
])
def test_bad_params_are_refused_with_their_key(optimizer, problem):
    with pytest.raises(ConfigError) as caught:
        load_config({"train_batch_size": 2, "optimizer": optimizer}, world_size=1)
    assert any(line.startswith(problem) for line in caught.value.problems), caught.value.problems


@pytest.mark.parametrize(("type_name", "params", "planner_name", "k_fp32"), [
    ("Lars", {"momentum": 0.9}, "lars", 4), ("Lars", {"momentum": 0.0}, "sgd", 0),
    ("Adam8bit", {}, "adam8bit", 2 + 8 / 256), ("AdamW8bit", {}, "adamw8bit", 2 + 8 / 256),
    ("Adafactor", {}, "adafactor", 8 / 1024), ("Muon", {}, "muon", 4),
])
def test_k_is_the_planners(type_name, params, planner_name, k_fp32):
    spec = optimizer_spec(type_name)
    assert spec.per_parameter
    assert spec.state_bytes_per_param(params, "fp32") == k_fp32
    assert spec.state_bytes_per_param(params, "bf16") == k_fp32 + 4  # the fp32 master copy
    if k_fp32:
        assert planned_state_bytes(planner_name, "fp32") == k_fp32
