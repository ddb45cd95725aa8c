"""A DeepSpeed config without `gradient_clipping` clips at a norm of 1.0 under
`deepspeed.initialize`, as DeepSpeed 0.19.8 does (its GRADIENT_CLIPPING_DEFAULT), at every
stage; 0 turns clipping off. With SGD at lr 1 one step moves the weights by the clipped
gradient: norm 1.0, where the gradient's own norm is 2,000."""

import os
import subprocess

import pytest
import torch
from torch import nn

import shardwise.frontends.deepspeed.api as deepspeed

GRADIENT_NORM = 2000.0  # 1000 x a (1, 4) input of ones: four elements of 1000


def update_norm(stage: int, **extra) -> tuple[float, float]:
    torch.manual_seed(0)
    model = nn.Linear(4, 1, bias=False)
    before = model.weight.detach().clone()
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 1.0}},
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True, **extra}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    engine.backward(1000 * engine(torch.ones(1, 4)).sum())
    engine.step()
    with deepspeed.zero.GatheredParameters([model.weight]):
        after = model.weight.detach().clone()
    return float((after - before).norm()), float(engine.gradient_clipping())


@pytest.mark.parametrize("stage", [0, 3])
def test_a_config_without_the_key_clips_at_one(stage):
    assert update_norm(stage) == pytest.approx((1.0, 1.0), rel=1e-6)


def test_zero_turns_clipping_off():
    assert update_norm(0, gradient_clipping=0.0) == pytest.approx((GRADIENT_NORM, 0.0), rel=1e-6)


@pytest.mark.skipif(not os.environ.get("DEEPSPEED_PYTHON"), reason="set DEEPSPEED_PYTHON to an interpreter with "
                    "DeepSpeed 0.19.8 to compare with its default")
def test_deepspeed_itself_clips_at_one_without_the_key():
    script = (
        "import os\n"
        "os.environ.update(RANK='0', WORLD_SIZE='1', LOCAL_RANK='0', MASTER_ADDR='127.0.0.1', MASTER_PORT='0')\n"
        "import torch, deepspeed\n"
        "from torch import nn\n"
        "deepspeed.init_distributed('gloo')\n"
        "torch.manual_seed(0)\n"
        "model = nn.Linear(4, 1, bias=False)\n"
        "before = model.weight.detach().clone()\n"
        "config = {'train_micro_batch_size_per_gpu': 1, 'optimizer': {'type': 'SGD', 'params': {'lr': 1.0}}}\n"
        "engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)\n"
        "engine.backward(1000 * engine(torch.ones(1, 4)).sum())\n"
        "engine.step()\n"
        "print('NORM', float((model.weight.detach() - before).norm()))\n"
    )
    done = subprocess.run([os.environ["DEEPSPEED_PYTHON"], "-c", script], capture_output=True, text=True,
                          env={**os.environ, "DS_ACCELERATOR": "cpu"}, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("NORM")]
    assert lines, done.stdout[-2000:] + done.stderr[-2000:]
    assert float(lines[0].split()[1]) == pytest.approx(update_norm(0)[0], rel=1e-6)
