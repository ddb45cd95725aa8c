"""`deepspeed.runtime.fp16.loss_scaler`: the classes scripts import, to allow-list them for
`torch.load(weights_only=True)` and to scale their own fp16 loops; the dynamic scaler's
scale, hysteresis and iteration counters over a pattern of overflows, and its refusal at
the minimum scale, compared with DeepSpeed 0.19.8's own when DEEPSPEED_PYTHON names an
interpreter with it; and a checkpoint holding DeepSpeed's scaler and ZeRO stage read with
`torch.load(weights_only=True)` once they are allow-listed, as scripts do (with
`fragment_address`, which DeepSpeed's checkpoints also hold)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

OVERFLOWS = [True, False, True, True, False, False, False, False, False, True, False, False, False, False, False,
             False, True, True, True, False, False]
CASES = [dict(init_scale=2.0 ** 8, scale_window=3, min_scale=1.0, delayed_shift=2, consecutive_hysteresis=False),
         dict(init_scale=2.0 ** 8, scale_window=2, min_scale=16.0, delayed_shift=1, consecutive_hysteresis=True,
              raise_error_at_min_scale=False)]

SEQUENCES = """
import json, sys
import torch
from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler, DynamicLossScaler, LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum

torch.serialization.add_safe_globals([ZeroStageEnum, LossScaler, DynamicLossScaler])
overflows, cases = json.loads(sys.argv[1])
runs = []
for case in cases:
    scaler = DynamicLossScaler(**case)
    states = []
    for overflow in overflows:
        scaler.update_scale(overflow)
        states.append([scaler.cur_scale, scaler.cur_hysteresis, scaler.cur_iter, scaler.last_overflow_iter])
    runs.append(states)
at_minimum = DynamicLossScaler(init_scale=2.0, scale_window=10, min_scale=1.0, delayed_shift=1,
                               consecutive_hysteresis=False)
at_minimum.update_scale(True)
try:
    at_minimum.update_scale(True)
    refusal = ""
except Exception as error:
    refusal = str(error)
static = CreateLossScaler(torch.half, 128.0, False, None)
plain = CreateLossScaler(torch.float32, 128.0, True, None)
print(json.dumps({"runs": runs, "refusal": refusal, "static": [type(static).__name__, static.loss_scale],
                  "plain": [type(plain).__name__, plain.loss_scale]}))
"""

HEADER = "from shardwise.frontends.deepspeed.alias import install_alias\ninstall_alias()\n"
DEEPSPEED_HEADER = ("import os, deepspeed\n"  # its update_scale logs from rank 0: a group of one
                    "os.environ.update(RANK='0', WORLD_SIZE='1', LOCAL_RANK='0', MASTER_ADDR='127.0.0.1', "
                    "MASTER_PORT='0')\n"
                    "deepspeed.init_distributed('gloo')\n")


def _run(python: str, header: str) -> dict:
    environment = {**os.environ, "DS_ACCELERATOR": "cpu"}
    ran = subprocess.run([python, "-c", header + SEQUENCES, json.dumps([OVERFLOWS, CASES])], capture_output=True,
                         text=True, timeout=300, env=environment)
    assert ran.returncode == 0, ran.stderr[-3000:]
    return json.loads(ran.stdout.strip().splitlines()[-1])


def test_the_scalers_follow_deepspeeds_schedule():
    got = _run(sys.executable, HEADER)
    first = got["runs"][0]
    # delayed_shift 2: the first overflow only spends hysteresis, the next one halves
    assert first[0] == [256.0, 1, 1, 0] and first[2] == [128.0, 1, 3, 2]
    # with the hysteresis spent, the next overflow halves at once; then window 3: the clean
    # steps strictly between overflows count, so it doubles on the 4th clean step
    assert [state[0] for state in first[3:9]] == [64.0, 64.0, 64.0, 64.0, 128.0, 128.0]
    assert first[7][1] == 2  # and the hysteresis is refilled
    assert got["runs"][1][-1][0] >= 16.0  # never below min_scale, and no error without raise_error_at_min_scale
    assert got["refusal"].startswith("Current loss scale already at minimum")
    assert got["static"] == ["LossScaler", 128.0] and got["plain"] == ["LossScaler", 1.0]


def test_backward_scales_the_loss():
    from shardwise.frontends.deepspeed.api.runtime.fp16.loss_scaler import LossScaler

    weight = torch.ones(3, requires_grad=True)
    LossScaler(scale=8).backward((weight * 2).sum())
    assert torch.equal(weight.grad, torch.full((3,), 16.0))


@pytest.mark.skipif(not os.environ.get("DEEPSPEED_PYTHON"), reason="set DEEPSPEED_PYTHON to an interpreter with "
                    "DeepSpeed 0.19.8 to compare with its scalers")
def test_deepspeeds_scalers_give_the_same_sequences():
    assert _run(os.environ["DEEPSPEED_PYTHON"], DEEPSPEED_HEADER) == _run(sys.executable, HEADER)


SAVE = """
import sys, torch
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address
scaler = DynamicLossScaler(init_scale=2.0 ** 10, scale_window=2, min_scale=1.0, delayed_shift=2,
                           consecutive_hysteresis=False)
for overflow in (True, False, True, False, False, False):
    scaler.update_scale(overflow)
torch.save({"stage": ZeroStageEnum.weights, "scaler": scaler, "static": LossScaler(16),
            "address": fragment_address(numel=6, start=2)}, sys.argv[1])
"""
LOAD = """
import json, sys, torch
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address
torch.serialization.add_safe_globals([ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address])
state = torch.load(sys.argv[1], weights_only=True)
scaler = state["scaler"]
counters = [scaler.cur_scale, scaler.cur_hysteresis, scaler.cur_iter, scaler.last_overflow_iter]
for overflow in (False, False, True):
    scaler.update_scale(overflow)
print(json.dumps({"stage": int(state["stage"]), "stage_name": state["stage"].name, "counters": counters,
                  "after": [scaler.cur_scale, scaler.cur_hysteresis, scaler.cur_iter],
                  "static": state["static"].loss_scale, "address": [state["address"].numel, state["address"].start]}))
"""


def _script(python: str, header: str, body: str, *args: str) -> str:
    environment = {**os.environ, "DS_ACCELERATOR": "cpu"}
    ran = subprocess.run([python, "-c", header + body, *args], capture_output=True, text=True, timeout=300,
                         env=environment)
    assert ran.returncode == 0, ran.stderr[-3000:]
    return ran.stdout


def test_a_saved_scaler_loads_with_weights_only_once_allow_listed(tmp_path):
    path = str(tmp_path / "state.pt")
    _script(sys.executable, HEADER, SAVE, path)
    loaded = json.loads(_script(sys.executable, HEADER, LOAD, path).strip().splitlines()[-1])
    # saved: an overflow spent the hysteresis, the next halved (512), window 2 doubled (1024);
    # loaded, it goes on: the 4th clean step since the overflow doubles, an overflow spends
    assert loaded["counters"] == [1024.0, 2, 6, 2] and loaded["after"] == [2048.0, 1, 9]
    assert (loaded["stage"], loaded["stage_name"], loaded["static"], loaded["address"]) == (3, "weights", 16, [6, 2])


@pytest.mark.skipif(not os.environ.get("DEEPSPEED_PYTHON"), reason="set DEEPSPEED_PYTHON to an interpreter with "
                    "DeepSpeed 0.19.8 to read its pickled scaler")
def test_deepspeeds_pickled_scaler_loads_and_goes_on_as_in_deepspeed(tmp_path):
    path = str(tmp_path / "deepspeed_state.pt")
    _script(os.environ["DEEPSPEED_PYTHON"], DEEPSPEED_HEADER, SAVE, path)
    ours = json.loads(_script(sys.executable, HEADER, LOAD, path).strip().splitlines()[-1])
    theirs = json.loads(_script(os.environ["DEEPSPEED_PYTHON"], DEEPSPEED_HEADER, LOAD, path).strip().splitlines()[-1])
    assert ours == theirs
