"""Rank function for test_tensor_fragment.py: DeepSpeed's safe_* helpers on a 2-rank engine,
against the same training done by torch alone on the whole global batch."""

from __future__ import annotations

import torch
from torch import nn

import shardwise.frontends.deepspeed.api as deepspeed
from shardwise.frontends.deepspeed.api.utils import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_set_full_fp32_param,
    safe_set_full_optimizer_state,
    safe_update_full_grad_vectorized,
)

EPS = 1e-4  # tests/runtime/zero/workers.py: Adam's eps >= 1e-4 keeps last-bit differences small


def model() -> nn.Module:
    torch.manual_seed(0)
    built = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    built[0].bias.requires_grad_(False)  # frozen: None from every helper
    return built


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(4, 6, generator=generator), torch.randn(4, 3, generator=generator)


def reference() -> dict:
    """Torch alone: gradients of the global batch's mean loss, Adam's state after one step."""
    net = model()
    x, y = batch()
    ((net(x) - y) ** 2).mean().backward()
    grads = {name: p.grad.clone() for name, p in net.named_parameters() if p.requires_grad}
    optimizer = torch.optim.Adam([p for p in net.parameters() if p.requires_grad], lr=0.01, eps=EPS)
    optimizer.step()
    moments = {name: optimizer.state[p]["exp_avg"].clone() for name, p in net.named_parameters() if p.requires_grad}
    weights = {name: p.detach().clone() for name, p in net.named_parameters()}
    return {"grads": grads, "moments": moments, "weights": weights}


def helpers(rank: int, world_size: int, stage: int) -> dict:
    net = model()
    x, y = batch()
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
              "gradient_clipping": 0.0,  # no clipping, as the reference; DeepSpeed 0.19.8 clips at 1.0 without the key
              "optimizer": {"type": "Adam", "params": {"lr": 0.01, "eps": EPS}}}
    engine, *_ = deepspeed.initialize(model=net, model_parameters=[p for p in net.parameters() if p.requires_grad],
                                      config=config)
    mine = slice(2 * rank, 2 * rank + 2)
    engine.backward(((engine(x[mine]) - y[mine]) ** 2).mean())
    params = dict(net.named_parameters())
    report = {
        "grads": {name: safe_get_full_grad(p) for name, p in params.items()},
        "local_grads": {name: safe_get_local_grad(p) for name, p in params.items()},
        "masters_before": {name: safe_get_full_fp32_param(p) for name, p in params.items()},
        "local_masters": {name: safe_get_local_fp32_param(p) for name, p in params.items()},
    }
    # DeepSpeed's call: once per parameter, (full gradient, parameter); doubled, then halved back
    seen = []
    safe_update_full_grad_vectorized(list(params.values()), lambda grad, param: (seen.append(param), grad * 2.0)[1])
    report["doubled_grads"] = {name: safe_get_full_grad(p) for name, p in params.items()}
    with_grads = [p for name, p in params.items() if report["grads"][name] is not None]  # not the frozen bias
    report["update_saw_every_param"] = [id(p) for p in seen] == [id(p) for p in with_grads]
    safe_update_full_grad_vectorized(list(params.values()), lambda grad, param: grad / 2.0)
    engine.step()
    report["moments"] = {name: safe_get_full_optimizer_state(p, "exp_avg") for name, p in params.items()}
    report["weights"] = {name: safe_get_full_fp32_param(p) for name, p in params.items()}
    # edits: a master set whole must reach the forward; a moment set whole must read back
    safe_set_full_fp32_param(params["2.bias"], torch.tensor([1.0, 2.0, 3.0]))
    safe_set_full_optimizer_state(params["2.bias"], torch.tensor([0.5, 0.5, 0.5]), "exp_avg")
    with torch.no_grad():
        report["output_after_edit"] = engine(torch.zeros(1, 6)).detach()
    with deepspeed.zero.GatheredParameters([params["2.weight"], params["0.bias"]]):
        report["expected_after_edit"] = (torch.tanh(params["0.bias"]) @ params["2.weight"].t()
                                         + torch.tensor([1.0, 2.0, 3.0])).detach().reshape(1, 3)
    report["moment_after_edit"] = safe_get_full_optimizer_state(params["2.bias"], "exp_avg")
    return report
