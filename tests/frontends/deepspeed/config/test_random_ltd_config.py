"""`data_efficiency.data_routing.random_ltd` as DeepSpeed 0.19.8 reads it
(runtime/data_pipeline/config.py and the keys data_routing/ reads): the block becomes the
typed RandomLTDPolicy, only `random_ltd.enabled` switches it on, and what DeepSpeed would
fail on is refused with the key."""

import json
import os
import subprocess

import pytest

from shardwise.frontends.deepspeed.config import ConfigError, load_config
from shardwise.frontends.deepspeed.config.policies import policies_from_config
from shardwise.runtime.data.random_ltd import RandomLTDPolicy

BLOCK = {
    "enabled": True, "total_layer_num": 12, "random_ltd_layer_num": 10, "random_ltd_layer_id": list(range(1, 11)),
    "model_mask_name": "attention_mask", "model_type": "decoder", "hidden_state_order": "seq_batch_dim",
    "random_ltd_schedule": {"min_value": 128, "max_value": 2048, "schedule_type": "fixed_linear",
                            "schedule_config": {"require_steps": 200000, "seq_per_step": 16}},
    "layer_token_lr_schedule": {"enabled": False, "total_layer_tokens": 10, "warmup_type": "linear"},
}


def config(block: dict, **data_efficiency) -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
            "data_efficiency": {**data_efficiency, "data_routing": {"random_ltd": block}}}


def policy(block: dict, **data_efficiency) -> RandomLTDPolicy | None:
    return policies_from_config(load_config(config(block, **data_efficiency), world_size=2)).random_ltd


def test_the_block_becomes_the_policy():
    # DeepSpeed runs it on random_ltd.enabled alone (data_efficiency.enabled stays false here)
    assert policy(BLOCK, seed=9) == RandomLTDPolicy(
        total_layer_num=12, layer_ids=tuple(range(1, 11)), min_value=128, max_value=2048, require_steps=200000,
        seq_per_step=16, global_batch_size=16, model_type="decoder", hidden_state_order="seq_batch_dim",
        mask_name="attention_mask", seed=9)
    assert policy(BLOCK).seed == 1234  # data_efficiency.seed's default


def test_switched_off_it_reads_nothing_else():
    assert policy({"enabled": False, "total_layer_num": 12}) is None
    assert policies_from_config(load_config({"train_micro_batch_size_per_gpu": 1}, world_size=1)).random_ltd is None


@pytest.mark.parametrize(("change", "message"), [
    ({"random_ltd_layer_num": 9}, "random_ltd_layer_num 9 must equal"),
    ({"random_ltd_layer_id": [0, 1, 2, 3, 4, 5, 6, 7, 8, 12]}, "[0, total_layer_num=12)"),
    ({"layer_token_lr_schedule": {"enabled": True}}, "NotImplementedError"),
    ({"random_ltd_schedule": {**BLOCK["random_ltd_schedule"], "schedule_type": "fixed_root"}}, "fixed_linear"),
    ({"random_ltd_schedule": {**BLOCK["random_ltd_schedule"], "min_value": 4096}}, "is above max_value"),
    ({"model_type": "encoder", "model_mask_name": None}, "needs model_mask_name"),
    ({"hidden_state_order": "seq_first"}, "batch_seq_dim"),
])
def test_what_deepspeed_would_fail_on_is_refused_by_key(change, message):
    with pytest.raises(ConfigError) as raised:
        policy({**BLOCK, **change})
    assert message in str(raised.value)


def test_a_missing_required_key_is_named():
    block = {key: value for key, value in BLOCK.items() if key != "model_mask_name"}
    with pytest.raises(ConfigError) as raised:
        policy(block)
    assert "random_ltd.enabled needs model_mask_name" in str(raised.value)


DEEPSPEED_SIDE = """
import json, sys
from deepspeed.runtime.data_pipeline.config import get_data_efficiency_config
block = get_data_efficiency_config(json.loads(sys.argv[1]))["data_routing"]["random_ltd"]
print(json.dumps(block))
"""


@pytest.mark.skipif(not os.environ.get("DEEPSPEED_PYTHON"), reason="set DEEPSPEED_PYTHON to an interpreter with "
                    "DeepSpeed installed (benchmarks/zero3_vs_fsdp2_deepspeed.py's docstring shows one)")
def test_deepspeed_reads_the_same_settings():
    ran = subprocess.run([os.environ["DEEPSPEED_PYTHON"], "-c", DEEPSPEED_SIDE, json.dumps(config(BLOCK))],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert ran.returncode == 0, ran.stderr[-2000:]
    theirs = json.loads(ran.stdout.strip().splitlines()[-1])
    ours = policy(BLOCK)
    schedule = theirs["random_ltd_schedule"]
    assert (theirs["enabled"], theirs["total_layer_num"], tuple(theirs["random_ltd_layer_id"]),
            theirs["model_mask_name"], theirs["model_type"], theirs["hidden_state_order"]) == (
        True, ours.total_layer_num, ours.layer_ids, ours.mask_name, ours.model_type, ours.hidden_state_order)
    assert (schedule["min_value"], schedule["max_value"], schedule["schedule_config"]["require_steps"],
            schedule["schedule_config"]["seq_per_step"]) == (ours.min_value, ours.max_value, ours.require_steps,
                                                              ours.seq_per_step)
