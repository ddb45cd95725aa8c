"""`compile=True` (optim/compiled.py): LAMB's and LARS's compiled per-tensor loops compute
the eager multi-tensor step. Slow (compiling takes a minute or more with Inductor's cache
cold), so run only with -m slow or SHARDWISE_SLOW_TESTS=1, as tests/frontends/deepspeed/api's slow tests."""

import os

import pytest
import torch

from shardwise.runtime.optim import native
from shardwise.runtime.optim.lamb import Lamb
from shardwise.runtime.optim.lars import Lars
from tests.runtime.optim.pieces import train_whole

# 2-D and 3-D tensors large enough to be compiled; a vector and a scalar stay eager
SHAPES = [(40, 240), (3, 5, 700), (64, 64), (300,), ()]

OPTIMIZERS = {
    "lamb": lambda compile: lambda params: Lamb(params, lr=0.01, weight_decay=0.01, compile=compile),
    "lamb-eps-inside": lambda compile: lambda params: Lamb(params, lr=0.01, eps_inside_sqrt=True, compile=compile),
    "lars": lambda compile: lambda params: Lars(params, lr=0.5, momentum=0.9, weight_decay=0.01, compile=compile),
    "lars-nesterov": lambda compile: lambda params: Lars(params, lr=0.5, momentum=0.9, nesterov=True,
                                                         compile=compile),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_compiled_step_equals_the_eager_one(name, request, monkeypatch):
    if os.environ.get("SHARDWISE_SLOW_TESTS") != "1" and "slow" not in (request.config.option.markexpr or ""):
        pytest.skip("slow: run with -m slow or SHARDWISE_SLOW_TESTS=1")
    monkeypatch.setenv(native.ENABLE_VARIABLE, "0")  # the torch path, compiled or not (the kernels: test_native.py)
    generator = torch.Generator().manual_seed(0)
    initial = [torch.randn(shape, generator=generator) for shape in SHAPES]
    grads = [[torch.randn(shape, generator=generator) for shape in SHAPES] for _ in range(4)]
    eager, eager_optimizer = train_whole(OPTIMIZERS[name](False), initial, grads)
    compiled, compiled_optimizer = train_whole(OPTIMIZERS[name](True), initial, grads)
    for mine, reference in zip(compiled, eager):
        assert ((mine - reference).norm() / reference.norm()).item() < 1e-6
    assert torch.allclose(compiled_optimizer.last_trust_ratios, eager_optimizer.last_trust_ratios, rtol=1e-6)
