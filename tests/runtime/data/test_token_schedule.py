"""Random-LTD's token-count schedule (runtime/data/token_schedule.py): DeepSpeed 0.19.8's
RandomLTDScheduler values by hand and (with DEEPSPEED_PYTHON set) from DeepSpeed itself,
the consumed layer-tokens, and the state a checkpoint keeps."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from shardwise.runtime.data.token_schedule import RandomLTDScheduler

CONFIGS = [
    {"total_layer_num": 12, "random_ltd_layer_num": 10, "global_batch_size": 4,
     "random_ltd_schedule": {"min_value": 128, "max_value": 512, "schedule_type": "fixed_linear",
                             "schedule_config": {"require_steps": 20, "seq_per_step": 16}},
     "layer_token_lr_schedule": {"enabled": False}},
    {"total_layer_num": 6, "random_ltd_layer_num": 4, "global_batch_size": 8,
     "random_ltd_schedule": {"min_value": 10, "max_value": 100, "schedule_type": "fixed_linear",
                             "schedule_config": {"require_steps": 30, "seq_per_step": 16}}},
]
STEPS = range(0, 35)


def trajectory(config: dict) -> list:
    scheduler = RandomLTDScheduler(config)
    out = []
    for step in STEPS:
        scheduler.update_seq(step)
        scheduler.update_seq(step)  # a second call in the same step adds nothing
        out.append([scheduler.get_current_seq(), scheduler.state["consumed_layer_tokens"]])
    return out


def test_kept_tokens_and_layer_tokens_by_hand():
    first = trajectory(CONFIGS[0])
    # s = 5: floor(5/20 * 384 + 128) = 224, a multiple of 16; from s = 20: 512
    assert [first[s][0] for s in (0, 5, 19, 20, 34)] == [128, 224, 480, 512, 512]  # 19: 492.8 -> 480
    # step 0: 4 x (128 x 10 + 512 x 2) layer-tokens
    assert first[0][1] == 4 * (128 * 10 + 512 * 2)
    second = trajectory(CONFIGS[1])
    assert second[0][0] == 0  # 10 rounded down to a multiple of 16, not raised back to min (DeepSpeed's rule)


def test_state_dict_round_trip_resumes_the_count():
    straight = RandomLTDScheduler(CONFIGS[0])
    for step in range(10):
        straight.update_seq(step)
    resumed = RandomLTDScheduler(CONFIGS[0])
    resumed.load_state_dict(json.loads(json.dumps(straight.state_dict())))
    for step in range(10, 25):
        straight.update_seq(step)
        resumed.update_seq(step)
    assert resumed.state_dict() == straight.state_dict()


@pytest.mark.parametrize(("change", "message"), [
    ({"layer_token_lr_schedule": {"enabled": True}}, "layer_token_lr_schedule"),
    ({"random_ltd_schedule": {**CONFIGS[0]["random_ltd_schedule"], "schedule_type": "fixed_root"}}, "fixed_linear"),
    ({"random_ltd_schedule": {**CONFIGS[0]["random_ltd_schedule"], "schedule_config": {"require_steps": 5}}},
     "seq_per_step"),
])
def test_unsupported_blocks_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        RandomLTDScheduler({**CONFIGS[0], **change})


DEEPSPEED_SIDE = """
import json, sys
from deepspeed.runtime.data_pipeline.data_routing.scheduler import RandomLTDScheduler
configs, steps = json.loads(sys.argv[1])
out = []
for config in configs:
    config.setdefault("layer_token_lr_schedule", {"enabled": False})
    scheduler = RandomLTDScheduler(config)
    rows = []
    for step in steps:
        scheduler.update_seq(step)
        scheduler.update_seq(step)
        rows.append([scheduler.get_current_seq(), scheduler.state["consumed_layer_tokens"]])
    out.append(rows)
print(json.dumps(out))
"""


@pytest.mark.skipif(not os.environ.get("DEEPSPEED_PYTHON"), reason="set DEEPSPEED_PYTHON to an interpreter with "
                    "DeepSpeed installed (benchmarks/zero3_vs_fsdp2_deepspeed.py's docstring shows one)")
def test_equals_deepspeeds_scheduler():
    run = subprocess.run([os.environ["DEEPSPEED_PYTHON"], "-c", DEEPSPEED_SIDE, json.dumps([CONFIGS, list(STEPS)])],
                         check=True, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "DS_ACCELERATOR": "cpu"})
    theirs = json.loads(run.stdout.strip().splitlines()[-1])
    assert [trajectory(config) for config in CONFIGS] == theirs
