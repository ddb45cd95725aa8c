"""Values DeepSpeed 0.19.8 accepts without a word but that cannot mean what the user wants
(reliability issue 30): a config error naming the key, why, and the fix."""

import pytest

from shardwise.frontends.deepspeed.config import ConfigError, load_config


def problems_of(zero: dict) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load_config({"train_batch_size": 8, "zero_optimization": zero}, world_size=2)
    return caught.value.problems


def test_sub_group_size_zero_is_refused():
    # DeepSpeed makes every parameter its own sub-group; shardwise read 0 as "no limit"
    assert problems_of({"stage": 3, "sub_group_size": 0}) == [
        "zero_optimization.sub_group_size: sub_group_size 0 must be a positive number of elements: the "
        "optimizer steps (and offload pages) that many at once; use a large value such as 1e9 for one sub-group"
    ]


def test_an_offload_ratio_of_zero_is_refused():
    assert problems_of({"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0}}) == [
        "zero_optimization.offload_optimizer.ratio: ratio 0.0 offloads no part of the optimizer state: give the "
        "fraction to offload in (0, 1], or set offload_optimizer.device to \"none\" to keep it all on the device"
    ]
