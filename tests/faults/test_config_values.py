"""Values DeepSpeed 0.19.8 accepts without a word but that cannot mean what the user wants
(reliability issue 30): a config error naming the key, why, and the fix."""

import pytest

from shardwise.frontends.deepspeed.config import ConfigError, load_config


def problems_of(zero: dict) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load_config({"train_batch_size": 8, "zero_optimization": zero}, world_size=2)
    return caught.value.problems


def test_a_negative_sub_group_size_is_refused():
    # 0 is DeepSpeed's one parameter per sub-group (axolotl's ZeRO configs set it): honoured,
    # tests/runtime/zero/test_sub_groups.py
    assert problems_of({"stage": 3, "sub_group_size": -1}) == [
        "zero_optimization.sub_group_size: sub_group_size -1 is not a number of elements: the optimizer steps "
        "(and offload pages) that many at once; use a positive size, or 0 for one parameter at a time"
    ]


def test_an_offload_ratio_of_zero_is_refused():
    assert problems_of({"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0}}) == [
        "zero_optimization.offload_optimizer.ratio: ratio 0.0 offloads no part of the optimizer state: give the "
        "fraction to offload in (0, 1], or set offload_optimizer.device to \"none\" to keep it all on the device"
    ]
