"""`zero_optimization.zenflow` as DeepSpeed 0.19.8 reads it (runtime/zenflow/zenflow_config.py
and engine.py): its keys become the typed `ZenFlowPolicy`, and what shardwise does not run
is refused with the key and the fix."""

import pytest

from shardwise.frontends.deepspeed.config import ConfigError, load_config
from shardwise.frontends.deepspeed.config.policies import policies_from_config
from shardwise.runtime.zero.policy import ZenFlowPolicy

CPU = {"offload_optimizer": {"device": "cpu"}}


def zenflow(block: dict, stage: int = 2, **top) -> ZenFlowPolicy:
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage, **CPU, "zenflow": block},
              **top}
    return policies_from_config(load_config(config, world_size=1)).zero.zenflow


def test_keys_become_the_policy():
    policy = zenflow({"topk_ratio": 0.05, "select_strategy": "step", "select_interval": 8, "update_interval": 4,
                      "full_warm_up_rounds": 2, "overlap_step": True, "offload": True,
                      "pt_reserved_cores_perc": 0.25})
    assert policy == ZenFlowPolicy(topk_ratio=0.05, update_interval=4, select_interval_steps=8,
                                   full_warm_up_rounds=2, overlap_step=True)


def test_auto_update_interval_is_deepspeeds_default():
    assert zenflow({}).update_interval == "auto"
    # no select_interval >= update_interval check for "auto" (DeepSpeed skips it too)
    assert zenflow({"select_strategy": "step", "select_interval": 1}).update_interval == "auto"


def test_epoch_strategies_wait_for_the_training_data():
    assert zenflow({"update_interval": 2}).select_interval_epochs == 1  # "auto": every epoch
    epochs = zenflow({"select_strategy": "epoch", "select_interval": 3, "update_interval": 2})
    assert (epochs.select_interval_steps, epochs.select_interval_epochs) == (0, 3)


@pytest.mark.parametrize(("block", "stage", "top", "message"), [
    ({"update_interval": 2, "topk_ratio": 1.0}, 2, {}, "topk_ratio"),
    ({"update_interval": 2, "select_strategy": "auto", "select_interval": 3}, 2, {}, 'select_strategy "auto"'),
    ({"update_interval": 2, "select_strategy": "step"}, 2, {}, "needs select_interval as a number"),
    ({"update_interval": 4, "select_strategy": "step", "select_interval": 2}, 2, {}, "select_interval 2 < "),
    ({"update_interval": 2}, 0, {}, "zenflow at zero_optimization.stage 0 is not supported"),
    ({"update_interval": 2}, 2, {"gradient_accumulation_steps": 2}, "set it to 1"),
    ({"update_interval": 2}, 2, {"fp16": {"enabled": True}}, "fp16.enabled is not supported"),
])
def test_what_is_not_run_is_refused_by_key(block, stage, top, message):
    with pytest.raises(ConfigError, match=None) as raised:
        zenflow(block, stage, **top)
    assert message in str(raised.value)


def test_zenflow_needs_the_cpu_optimizer():
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2, "zenflow": {"update_interval": 2}}}
    with pytest.raises(ConfigError) as raised:
        load_config(config, world_size=1)
    assert "zenflow needs zero_optimization.offload_optimizer.device 'cpu'" in str(raised.value)
