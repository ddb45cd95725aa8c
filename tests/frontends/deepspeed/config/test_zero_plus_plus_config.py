"""ZeRO++'s keys (C28) as DeepSpeed 0.19.8 reads them: `zero_quantized_weights`,
`zero_hpz_partition_size` (an integer >= 0; 0 and 1 are off) and
`zero_quantized_gradients` act at stage 3, and below it are parsed and ignored."""

import logging
import re

import pytest

from shardwise.frontends.deepspeed.config import ConfigError, load_config
from shardwise.frontends.deepspeed.config.policies import policies_from_config
from shardwise.runtime.zero.policy import OffloadPolicy, ZeroPlusPlusPolicy, ZeroPolicy

ALL_ON = {"zero_quantized_weights": True, "zero_hpz_partition_size": 8, "zero_quantized_gradients": True}


def plus_plus(zero: dict, world_size: int = 16) -> ZeroPlusPlusPolicy:
    cfg = load_config({"train_batch_size": world_size, "zero_optimization": zero}, world_size=world_size)
    return policies_from_config(cfg).zero.plus_plus


def test_stage_3_honours_the_three_keys():
    policy = plus_plus({"stage": 3, **ALL_ON})
    assert (policy.quantized_weights, policy.hpz_partition_size, policy.quantized_gradients) == (True, 8, True)
    assert plus_plus({"stage": 3, "zero_hpz_partition_size": 0}) == ZeroPlusPlusPolicy()  # 0 is off, as 1


def test_below_stage_3_they_are_ignored_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="shardwise"):
        assert plus_plus({"stage": 2, **ALL_ON}) == ZeroPlusPlusPolicy()
    assert "act on stage 3 only; at stage 2 they are ignored, as DeepSpeed ignores them" in caplog.text


@pytest.mark.parametrize(("zero", "message"), [
    ({"zero_hpz_partition_size": -1}, "zero_optimization.zero_hpz_partition_size"),
    ({"zero_quantized_weights": 1}, "zero_optimization.zero_quantized_weights"),
    ({"mics_shard_size": 8, "zero_quantized_gradients": True},
     "zero_optimization.zero_quantized_gradients (ZeRO++) with mics_shard_size is not supported"),
    ({"zero_hpz_partition_size": 8, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
     "zero_hpz_partition_size 8 with offload_param.device 'cpu' is not supported"),
])
def test_settings_that_cannot_hold_are_refused(zero, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config({"train_batch_size": 16, "zero_optimization": {"stage": 3, **zero}}, world_size=16)


def test_the_policy_refuses_what_it_cannot_do():
    on = ZeroPlusPlusPolicy(quantized_weights=True)
    with pytest.raises(ValueError, match="stage 2 has neither: use stage 3"):
        ZeroPolicy(stage=2, plus_plus=on)
    with pytest.raises(ValueError, match="hybrid sharding"):
        ZeroPolicy(stage=3, shard_size=2, plus_plus=on)
    with pytest.raises(ValueError, match="offloaded parameters"):
        ZeroPolicy(stage=3, offload_param=OffloadPolicy("cpu"), plus_plus=ZeroPlusPlusPolicy(hpz_partition_size=2))
    with pytest.raises(ValueError, match="gradient_block must be an even number"):
        ZeroPlusPlusPolicy(gradient_block=3)
