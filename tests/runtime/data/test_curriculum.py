"""Curriculum learning's difficulty schedules (runtime/data/curriculum.py): the values
DeepSpeed 0.19.8's CurriculumScheduler gives, by hand and (with DEEPSPEED_PYTHON set) from
DeepSpeed itself over every step of each schedule."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from shardwise.runtime.data.curriculum import CurriculumScheduler

CONFIGS = [
    {"min_difficulty": 8, "max_difficulty": 64, "schedule_type": "fixed_linear",
     "schedule_config": {"total_curriculum_step": 20, "difficulty_step": 8}},
    {"min_difficulty": 10, "max_difficulty": 100, "schedule_type": "fixed_root",
     "schedule_config": {"total_curriculum_step": 30, "difficulty_step": 16, "root_degree": 2}},
    {"min_difficulty": 1, "max_difficulty": 3, "schedule_type": "fixed_discrete",
     "schedule_config": {"difficulty": [1, 2, 3], "max_step": [5, 10]}},
]
STEPS = range(0, 40)


def trajectory(config: dict) -> list:
    scheduler = CurriculumScheduler(config)
    return [scheduler.update_difficulty(step) for step in STEPS]


def test_linear_root_and_discrete_by_hand():
    linear, root, discrete = (trajectory(config) for config in CONFIGS)
    # linear: floor(s/20 * 56 + 8) down to a multiple of 8; s = 5: 22 -> 16; s = 20 on: 64
    assert (linear[0], linear[5], linear[10], linear[20], linear[39]) == (8, 16, 32, 64, 64)
    # root: sqrt(s/30) * 90 + 10, down to a multiple of 16, at least 16 (the first multiple >= 10)
    assert (root[0], root[1], root[8], root[30]) == (16, 16, 48, 96)
    assert root[39] == 100  # past the total: (39/30)^0.5 * 90 + 10 = 112 -> 112, capped at 100
    assert discrete[:12] == [1] * 6 + [2] * 5 + [3]


def test_difficulty_stops_once_at_the_maximum():
    scheduler = CurriculumScheduler(CONFIGS[2])
    assert scheduler.update_difficulty(11) == 3
    assert scheduler.update_difficulty(0) == 3  # never recomputed at the maximum
    assert scheduler.state["current_difficulty"] == 3


@pytest.mark.parametrize(("config", "message"), [
    ({"max_difficulty": 3, "schedule_type": "fixed_linear"}, "needs 'min_difficulty'"),
    ({**CONFIGS[0], "schedule_type": "fixed_cubic"}, "is not one of"),
    ({**CONFIGS[2], "schedule_config": {"difficulty": [1, 2], "max_step": [5, 10]}}, "one more difficulty"),
    ({**CONFIGS[1], "schedule_config": {"total_curriculum_step": 30, "difficulty_step": 16}}, "root_degree"),
])
def test_incomplete_blocks_are_refused(config, message):
    with pytest.raises(ValueError, match=message):
        CurriculumScheduler(config)


def test_custom_schedule_needs_its_function():
    scheduler = CurriculumScheduler({"min_difficulty": 1, "max_difficulty": 9, "schedule_type": "custom"})
    with pytest.raises(RuntimeError, match="set_custom_curriculum_learning_schedule"):
        scheduler.update_difficulty(1)
    scheduler.set_custom_get_difficulty(lambda step: step + 1)
    assert [scheduler.update_difficulty(step) for step in (1, 4, 20, 2)] == [2, 5, 21, 21]


DEEPSPEED_SIDE = """
import json, sys
from deepspeed.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler
configs, steps = json.loads(sys.argv[1])
out = []
for config in configs:
    scheduler = CurriculumScheduler(config)
    out.append([scheduler.update_difficulty(step) for step in steps])
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
