"""`deepspeed.runtime.constants`: the names scripts import hold DeepSpeed 0.19.8's values,
and, when DEEPSPEED_PYTHON is set, every constant equals DeepSpeed's own (besides the
`*_FORMAT` help texts, which are not provided)."""

from __future__ import annotations

import json
import os

import pytest

from shardwise.frontends.deepspeed.api.runtime import constants
from tests.frontends.deepspeed.deepspeed_side import deepspeed_json


def test_names_scripts_import():
    assert constants.GRADIENT_CLIPPING_DEFAULT == 1.0
    assert constants.SCHEDULER_TYPE_DEFAULT is None
    assert (constants.ROUTE_TRAIN, constants.ROUTE_EVAL, constants.ROUTE_PREDICT) == ("train", "eval", "predict")
    assert constants.PIPE_REPLICATED == "ds_pipe_replicated"
    assert (constants.BFLOAT16, constants.FP16) == ("bf16", "fp16")
    assert constants.GRADIENT_ACCUMULATION_STEPS == "gradient_accumulation_steps"
    assert constants.TRAIN_MICRO_BATCH_SIZE_PER_GPU == "train_micro_batch_size_per_gpu"
    assert constants.TRAIN_BATCH_SIZE == "train_batch_size"
    assert constants.GRADIENT_ALLREDUCE_OP_SUPPORTED == ("mean", "sum")
    assert constants.CHECKPOINT_TAG_VALIDATION_MODES == ["WARN", "IGNORE", "FAIL"]


DEEPSPEED_SIDE = """
import json, deepspeed.runtime.constants as c
print(json.dumps({name: getattr(c, name) for name in dir(c) if name.isupper() and not name.endswith("_FORMAT")}))
"""


@pytest.mark.skipif(not os.environ.get("DEEPSPEED_PYTHON"), reason="set DEEPSPEED_PYTHON to an interpreter with "
                    "DeepSpeed installed (benchmarks/zero3_vs_fsdp2_deepspeed.py's docstring shows one)")
def test_every_constant_equals_deepspeeds():
    theirs = deepspeed_json(DEEPSPEED_SIDE)
    ours = {name: getattr(constants, name) for name in dir(constants) if name.isupper()}
    assert json.loads(json.dumps(ours)) == theirs
