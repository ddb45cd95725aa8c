"""`deepspeed.runtime.config_utils`: a DeepSpeedConfigModel drops "auto", refuses unknown
keys, and moves a deprecated field's value to its replacement (refusing both at once);
the param readers, the duplicate-key hook and the scientific-notation encoder; and, when
DEEPSPEED_PYTHON is set, the same answers from DeepSpeed 0.19.8's own helpers."""

from __future__ import annotations

import json
import os

import pytest
from pydantic import Field, ValidationError

from shardwise.frontends.deepspeed.api.runtime.config_utils import (
    DeepSpeedConfigModel,
    DeepSpeedConfigObject,
    ScientificNotationEncoder,
    dict_raise_error_on_duplicate_keys,
    get_config_default,
    get_scalar_param,
    pp_int,
)
from tests.frontends.deepspeed.deepspeed_side import deepspeed_json


class Inner(DeepSpeedConfigModel):
    size: int = 4


class Block(DeepSpeedConfigModel):
    buckets: int = 10
    inner: Inner = Field(default_factory=Inner)
    old_buckets: str = Field("0", json_schema_extra={"deprecated": True, "new_param": "buckets",
                                                     "new_param_fn": int})
    old_size: int = Field(0, json_schema_extra={"deprecated": True, "new_param": "inner.size"})


def test_config_model_drops_auto_refuses_unknown_and_moves_deprecated_fields():
    assert Block(buckets="auto").buckets == 10
    with pytest.raises(ValidationError):
        Block(strict=True, buckets="auto")
    with pytest.raises(ValidationError, match="no_such_key"):
        Block(no_such_key=1)
    assert Block(old_buckets="7").buckets == 7
    assert Block(old_size=9).inner.size == 9
    with pytest.raises(AssertionError, match="Cannot provide deprecated parameter 'old_buckets' and replacing"):
        Block(old_buckets="7", buckets=3)
    assert get_config_default(Block, "buckets") == 10


def test_readers_duplicate_keys_and_printing():
    assert get_scalar_param({"a": 1}, "a", 0) == 1 and get_scalar_param({}, "a", 0) == 0
    with pytest.raises(ValueError, match=r"Duplicate keys in DeepSpeed config: \['lr'\]"):
        json.loads('{"lr": 1, "lr": 2, "x": 3}', object_pairs_hook=dict_raise_error_on_duplicate_keys)
    assert json.loads('{"lr": 1}', object_pairs_hook=dict_raise_error_on_duplicate_keys) == {"lr": 1}
    assert repr(pp_int(100000)) == "100,000" and repr(pp_int(5, "five")) == "five"
    printed = json.dumps({"bucket": 500000000, "lr": 0.5, "on": True, "list": [1, 20000]}, indent=2,
                         cls=ScientificNotationEncoder)
    assert printed == '{\n  "bucket": 5.000000e+08, \n  "lr": 0.5, \n  "on": true, \n  "list": [1, 2.000000e+04]\n}'
    holder = DeepSpeedConfigObject()
    holder.size = 2000
    assert repr(holder) == '{\n    "size": 2.000000e+03\n}'


DEEPSPEED_SIDE = """
import json
from deepspeed.runtime.config_utils import DeepSpeedConfigObject, ScientificNotationEncoder
holder = DeepSpeedConfigObject()
holder.size = 2000
print(json.dumps([json.dumps({"bucket": 500000000, "lr": 0.5, "on": True, "list": [1, 20000]}, indent=2,
                             cls=ScientificNotationEncoder), repr(holder)]))
"""


@pytest.mark.skipif(not os.environ.get("DEEPSPEED_PYTHON"), reason="set DEEPSPEED_PYTHON to an interpreter with "
                    "DeepSpeed installed (benchmarks/zero3_vs_fsdp2_deepspeed.py's docstring shows one)")
def test_printing_equals_deepspeeds():
    printed, holder = deepspeed_json(DEEPSPEED_SIDE)
    assert printed == json.dumps({"bucket": 500000000, "lr": 0.5, "on": True, "list": [1, 20000]}, indent=2,
                                 cls=ScientificNotationEncoder)
    ours = DeepSpeedConfigObject()
    ours.size = 2000
    assert holder == repr(ours)
