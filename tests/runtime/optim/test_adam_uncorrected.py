"""Adam with `bias_correction: false`, as DeepSpeed's Adam kernels compute it
(csrc/adam/multi_tensor_adam.cu: both correction factors 1): checked against the update
written out in float64, in AdamW and L2 mode, and through a config."""

import pytest
import torch

import shardwise
from shardwise.runtime.optim.adam_uncorrected import UncorrectedAdam
from shardwise.runtime.optim.registry import optimizer_spec

LR, BETAS, EPS, DECAY = 1e-2, (0.9, 0.999), 1e-6, 0.1


def written_out(param: torch.Tensor, grads: list[torch.Tensor], adam_w_mode: bool, decay: float = DECAY) -> torch.Tensor:
    """DeepSpeed's kernel per element, in float64, without bias correction."""
    p, m, v = param.double().clone(), torch.zeros_like(param, dtype=torch.float64), torch.zeros_like(
        param, dtype=torch.float64)
    for grad in grads:
        g = grad.double() + (0 if adam_w_mode else decay * p)
        m = BETAS[0] * m + (1 - BETAS[0]) * g
        v = BETAS[1] * v + (1 - BETAS[1]) * g * g
        update = m / (v.sqrt() + EPS) + (decay * p if adam_w_mode else 0)
        p = p - LR * update
    return p


@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["adamw", "l2"])
def test_update_is_deepspeeds_without_bias_correction(adam_w_mode):
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(64))
    start = param.detach().clone()
    grads = [torch.randn(64) for _ in range(4)]
    optimizer = UncorrectedAdam([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=DECAY, adam_w_mode=adam_w_mode)
    for grad in grads:
        param.grad = grad.clone()
        optimizer.step()
    expected = written_out(start, grads, adam_w_mode)
    assert ((param.double() - expected).norm() / expected.norm()).item() < 1e-6
    corrected = torch.optim.AdamW([torch.nn.Parameter(start.clone())], lr=LR, betas=BETAS, eps=EPS,
                                  weight_decay=DECAY)
    first = corrected.param_groups[0]["params"][0]
    first.grad = grads[0].clone()
    corrected.step()  # corrected, the first step is lr·g/|g|; raw moments give √10 times that
    assert not torch.allclose(first.double(), written_out(start, grads[:1], True), rtol=1e-3)


def test_the_config_key_builds_it_and_the_engine_trains_with_it():
    built = optimizer_spec("Adam").build([{"params": [torch.nn.Parameter(torch.zeros(2))]}],
                                         {"lr": LR, "bias_correction": False, "adam_w_mode": False, "betas": BETAS,
                                          "eps": EPS, "weight_decay": DECAY, "amsgrad": False, "torch_adam": False})
    assert isinstance(built, UncorrectedAdam) and built.param_groups[0]["adam_w_mode"] is False
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    start = model.weight.detach().clone()
    engine = shardwise.initialize(model, {"train_micro_batch_size_per_gpu": 2, "optimizer": {
        "type": "Adam", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "bias_correction": False}}})
    x = torch.randn(2, 4)
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()
    weight = start.clone().requires_grad_()
    grad = torch.autograd.grad(torch.nn.functional.linear(x, weight, model.bias.detach()).pow(2).mean(), weight)[0]
    expected = written_out(start.detach(), [grad], adam_w_mode=True, decay=0.0)  # the config's default decay
    assert torch.allclose(model.weight.detach().double(), expected, rtol=1e-5, atol=1e-7)
    engine.destroy()
