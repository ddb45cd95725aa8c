"""LAMB and 8-bit AdamW on their Triton kernels (shardwise/runtime/optim/triton_kernels.py)
on CUDA: the optimizers take them, and from the same weights, gradients and state a step
on them equals a step on the torch path (LAMB to fp32 rounding; 8-bit AdamW within the
code flips that fused multiply-adds may cause). On CPU the same kernels are tested under
Triton's interpreter (tests/runtime/optim/test_triton_kernels.py)."""

import copy

import pytest
import torch

from tests.gpu.target import ON_CUDA

pytestmark = pytest.mark.skipif(not ON_CUDA, reason="the Triton kernels run on CUDA; on CPU, under Triton's "
                                "interpreter: tests/runtime/optim/test_triton_kernels.py")

SHAPES = [(512, 384), (4096,), (3, 5, 700), (77,)]


def _params() -> list[torch.nn.Parameter]:
    generator = torch.Generator(device="cuda").manual_seed(0)
    params = []
    for shape in SHAPES:
        param = torch.nn.Parameter(torch.randn(shape, device="cuda", generator=generator))
        param.grad = torch.randn(shape, device="cuda", generator=generator) * 0.1
        params.append(param)
    return params


def _step_both_ways(make, monkeypatch) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """A first step (state made), then one step on the Triton kernels and one on the torch
    path from copies of that state: both weight vectors and the kernels' call counts."""
    from shardwise.runtime.optim import triton_gate

    kernels = triton_gate.kernels()
    assert kernels is not None, "Triton must import on the GPU machine"
    calls = {}
    for name in ("lamb_moments_and_squares", "lamb_apply", "adam8bit_step"):
        def counted(*args, _name=name, _function=getattr(kernels, name), **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            return _function(*args, **kwargs)
        monkeypatch.setattr(kernels, name, counted)
    params = _params()
    optimizer = make(params)
    optimizer.step()
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for twin, param in zip(twins, params):
        twin.grad = param.grad.clone()
    twin_optimizer = make(twins)
    twin_optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    optimizer.step()
    monkeypatch.setenv(triton_gate.ENABLE_VARIABLE, "0")
    twin_optimizer.step()
    mine = torch.cat([p.detach().reshape(-1) for p in params])
    reference = torch.cat([p.detach().reshape(-1) for p in twins])
    return mine, reference, calls


def test_lamb_on_the_triton_kernels_steps_as_its_torch_path(monkeypatch):
    from shardwise.runtime.optim.lamb import Lamb

    mine, reference, calls = _step_both_ways(lambda params: Lamb(params, lr=0.01, weight_decay=0.01), monkeypatch)
    assert calls == {"lamb_moments_and_squares": 2, "lamb_apply": 2}
    assert ((mine - reference).norm() / reference.norm()).item() < 1e-6


def test_8bit_adamw_on_the_triton_kernel_steps_as_its_torch_path(monkeypatch):
    from shardwise.runtime.optim.adam8bit import AdamW8bit

    mine, reference, calls = _step_both_ways(lambda params: AdamW8bit(params, lr=0.01, min_8bit_size=1000),
                                             monkeypatch)
    assert calls == {"adam8bit_step": 2 * 3}  # three coded tensors, two steps
    assert ((mine - reference).norm() / reference.norm()).item() < 1e-5  # this step reads unquantised moments
