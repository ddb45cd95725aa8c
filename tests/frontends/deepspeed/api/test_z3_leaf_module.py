"""DeepSpeed's ZeRO-3 leaf modules: `deepspeed.utils.set_z3_leaf_modules` and friends
(called by Accelerate's `deepspeed_moe_layer_cls_names` and MoE fine-tuning scripts
before `initialize`) and the config's `zero_optimization.leaf_module` block. Either way
the marked MoE block trains as one process does (tests/runtime/zero/test_leaf_modules.py)."""

import json
import os
import subprocess

import pytest
from torch import nn

from shardwise.frontends.deepspeed.api import utils as deepspeed_utils
from shardwise.tools.testing import run_distributed
from tests.runtime.zero.test_leaf_modules import CONFIG, TopOneExperts, assert_trains_as_one_process, build, train
from tests.frontends.deepspeed.deepspeed_side import deepspeed_json


def flag_by_class(model: nn.Module) -> None:
    assert deepspeed_utils.set_z3_leaf_modules(model, [TopOneExperts]) == [model[1]]


@pytest.mark.parametrize("how", ["deepspeed.utils", "config"])
def test_the_flagged_block_trains_as_one_process(how):
    if how == "config":
        config = {**CONFIG, "zero_optimization": {**CONFIG["zero_optimization"],
                                                  "leaf_module": {"classes": "TopOneExperts"}}}
        results = run_distributed(train, 2, False, config)
    else:
        results = run_distributed(train, 2, False, CONFIG, flag_by_class)
    assert_trains_as_one_process(results)


def flags(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if deepspeed_utils.z3_leaf_module(module)]


def exercise(model: nn.Module) -> dict:
    """Every leaf-module function on one model, as DeepSpeed's own test would call them."""
    seen = {}
    seen["by_class_name"] = [type(m).__name__ for m in deepspeed_utils.set_z3_leaf_modules(model, ["Tanh"])]
    seen["after_class"] = flags(model)
    seen["unset"] = len(deepspeed_utils.unset_z3_leaf_modules(model, ["Tanh"]))
    found, missing = deepspeed_utils.set_z3_leaf_modules_by_name(model, ["1.experts.0", "9"], raise_if_not_found=False)
    seen["by_name"] = [len(found), missing]
    found, missing = deepspeed_utils.set_z3_leaf_modules_by_suffix(model, ["experts.1", "nothing"],
                                                                   raise_if_not_found=False)
    seen["by_suffix"] = [len(found), missing]
    seen["flags"] = flags(model)
    seen["listed"] = len(deepspeed_utils.get_z3_leaf_modules(model))
    for call in (lambda: deepspeed_utils.set_z3_leaf_modules(model, ["Conv2d"]),
                 lambda: deepspeed_utils.set_z3_leaf_modules_by_name(model, ["9"]),
                 lambda: deepspeed_utils.set_z3_leaf_modules_by_suffix(model, ["nothing"])):
        try:
            call()
            seen.setdefault("raised", []).append(None)
        except ValueError as error:
            seen.setdefault("raised", []).append(type(error).__name__)
    return seen


EXPECTED = {
    "by_class_name": ["Tanh"] * 4, "after_class": [f"1.experts.{e}.1" for e in range(4)], "unset": 4,
    "by_name": [1, ["9"]], "by_suffix": [1, ["nothing"]], "flags": ["1.experts.0", "1.experts.1"], "listed": 2,
    "raised": ["ValueError"] * 3,
}


def test_the_functions_answer_as_deepspeed_s():
    assert exercise(build()) == EXPECTED


DEEPSPEED_SIDE = """
import json, sys
sys.path.insert(0, sys.argv[1])
import torch
from deepspeed import utils as deepspeed_utils
import tests.frontends.deepspeed.api.test_z3_leaf_module as ours
ours.deepspeed_utils = deepspeed_utils
print(json.dumps(ours.exercise(ours.build())))
"""


@pytest.mark.skipif(not os.environ.get("DEEPSPEED_PYTHON"), reason="set DEEPSPEED_PYTHON to an interpreter with "
                    "DeepSpeed 0.19.8 installed")
def test_deepspeed_s_own_functions_answer_the_same():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))))
    ran = subprocess.run([os.environ["DEEPSPEED_PYTHON"], "-c", DEEPSPEED_SIDE, root], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert json.loads(ran.stdout.strip().splitlines()[-1]) == EXPECTED


GRANULARITY_SIDE = """
import json, os, sys
sys.path.insert(0, sys.argv[1])
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="0")  # any free port
import torch, deepspeed
from deepspeed.utils import z3_leaf_module
from tests.runtime.zero.test_leaf_modules import build
deepspeed.init_distributed("gloo")
chosen = {}
for threshold in json.loads(sys.argv[2]):
    model = build()
    deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config={
        "train_micro_batch_size_per_gpu": 1, "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": 3, "stage3_module_granularity_threshold": threshold}})
    chosen[threshold] = sorted(name for name, module in model.named_modules() if z3_leaf_module(module))
print(json.dumps(chosen))
"""


@pytest.mark.skipif(not os.environ.get("DEEPSPEED_PYTHON"), reason="set DEEPSPEED_PYTHON to an interpreter with "
                    "DeepSpeed 0.19.8 installed")
def test_deepspeed_s_granularity_threshold_chooses_the_same_modules():
    from shardwise.runtime.zero.leaf_modules import modules_under_granularity

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))))
    thresholds = [114, 115, 10**6]
    theirs = deepspeed_json(GRANULARITY_SIDE, root, json.dumps(thresholds))
    for threshold in thresholds:
        model = build()
        names = {module: name for name, module in model.named_modules()}
        assert sorted(names[m] for m in modules_under_granularity(model, threshold)) == theirs[str(threshold)]
