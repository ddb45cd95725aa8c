"""`deepspeed.runtime.utils.clip_grad_norm_` and `move_to_device`, as scripts import them:
the norm returned and the gradients clipped equal DeepSpeed 0.19.8's (when DEEPSPEED_PYTHON
names an interpreter with it), the norm is averaged over the data-parallel ranks as
DeepSpeed's is, and containers of tensors move whole."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from shardwise.frontends.deepspeed.api.runtime.utils import clip_grad_norm_, move_to_device
from shardwise.tools.testing import run_distributed

CLIPPING = """
import json, sys
import torch
from deepspeed.runtime.utils import clip_grad_norm_

results = []
for norm_type, max_norm in json.loads(sys.argv[1]):
    generator = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in ((4, 3), (5,), (2, 2, 2))]
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator) * 3
    norm = clip_grad_norm_(params, max_norm, norm_type=float(norm_type))
    results.append([norm.reshape(-1).tolist(), [param.grad.reshape(-1).tolist() for param in params]])
print(json.dumps(results))
"""
CASES = [[2, 1.0], ["inf", 0.5], [1, 2.0], [2, 1e6]]
HEADER = ("import os, torch.distributed as dist\n"
          "os.environ.update(RANK='0', WORLD_SIZE='1', LOCAL_RANK='0', MASTER_ADDR='127.0.0.1', MASTER_PORT='0')\n")


def _clipped(python: str, header: str) -> list:
    environment = {**os.environ, "DS_ACCELERATOR": "cpu"}
    ran = subprocess.run([python, "-c", header + CLIPPING, json.dumps(CASES)], capture_output=True, text=True,
                         timeout=300, env=environment)
    assert ran.returncode == 0, ran.stderr[-3000:]
    return json.loads(ran.stdout.strip().splitlines()[-1])


def test_clipping_matches_torchs_norm_and_scales_to_max_norm():
    results = _clipped(sys.executable, "from shardwise.frontends.deepspeed.alias import install_alias\n"
                                       "install_alias()\n")
    generator = torch.Generator().manual_seed(3)
    grads = [torch.randn(shape, generator=generator) * 3 for shape in ((4, 3), (5,), (2, 2, 2))]
    for (norm_type, max_norm), (norm, clipped) in zip(CASES, results):
        want = torch.linalg.vector_norm(torch.cat([grad.reshape(-1) for grad in grads]), float(norm_type))
        assert norm[0] == pytest.approx(want.item(), rel=1e-6)
        factor = min(1.0, max_norm / (want.item() + 1e-6))
        for grad, got in zip(grads, clipped):
            assert got == pytest.approx((grad.reshape(-1) * factor).tolist(), rel=1e-5)


@pytest.mark.skipif(not os.environ.get("DEEPSPEED_PYTHON"), reason="set DEEPSPEED_PYTHON to an interpreter with "
                    "DeepSpeed 0.19.8 to compare with its clip_grad_norm_")
def test_clipping_equals_deepspeeds():
    ours = _clipped(sys.executable, "from shardwise.frontends.deepspeed.alias import install_alias\n"
                                    "install_alias()\nimport deepspeed\n" + HEADER + "deepspeed.init_distributed('gloo')\n")
    theirs = _clipped(os.environ["DEEPSPEED_PYTHON"], "import deepspeed\n" + HEADER + "deepspeed.init_distributed('gloo')\n")
    assert ours == theirs


def _averaged(rank: int, world_size: int) -> list[float]:
    param = torch.nn.Parameter(torch.zeros(2))
    param.grad = torch.tensor([3.0, 4.0]) * (rank + 1)  # norms 5 and 10: expert-like gradients that differ
    norm = clip_grad_norm_([param], 1.0)
    return [norm.item(), *param.grad.tolist()]


def test_the_norm_is_averaged_over_the_data_parallel_ranks():
    mean = 7.5
    for rank, (norm, *grad) in enumerate(run_distributed(_averaged, 2, timeout=60)):
        assert norm == pytest.approx(mean)
        assert grad == pytest.approx([3.0 * (rank + 1) / (mean + 1e-6), 4.0 * (rank + 1) / (mean + 1e-6)])


def test_move_to_device_moves_containers_and_criterion_items_in_place():
    tensor = torch.ones(2, dtype=torch.float64)
    moved = move_to_device({"a": [tensor, (tensor,)], "b": tensor}, "meta")
    assert moved["a"][0].is_meta and moved["a"][1][0].is_meta and moved["b"].is_meta and not tensor.is_meta
    kept = move_to_device(tensor, "cpu", criterion_func=lambda item: torch.is_tensor(item))
    assert kept is tensor
