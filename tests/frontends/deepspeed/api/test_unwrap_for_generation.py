"""`unwrap_model_for_generation`: under ZeRO-3, inside the block every parameter is whole
and a forward gives the single-process model's output, however many forwards each rank
runs; training goes on after it."""

import torch
from torch import nn

from shardwise.tools.testing import run_distributed

FP32 = 1e-5


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _generate_between_steps(rank: int, world_size: int) -> dict:
    import shardwise.frontends.deepspeed.api as deepspeed
    from shardwise.frontends.deepspeed.api.runtime.zero import unwrap_model_for_generation

    reference = _model()
    model = _model()
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, _, _, _ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    inputs = torch.randn(2, 6, generator=torch.Generator().manual_seed(1))
    with unwrap_model_for_generation(engine) as unwrapped:
        sizes = [parameter.numel() for parameter in unwrapped.module.parameters()]
        with torch.no_grad():
            for _ in range(rank + 1):  # ranks whose sequences end at different lengths
                generated = unwrapped(inputs)
    loss = engine(inputs).square().sum()
    engine.backward(loss)
    engine.step()
    return {"sizes": sizes, "expected_sizes": [p.numel() for p in reference.parameters()],
            "error": ((generated - reference(inputs)).norm() / reference(inputs).norm()).item(),
            "loss": loss.item()}


def test_unwrap_model_for_generation_holds_zero3_parameters_whole():
    for report in run_distributed(_generate_between_steps, 2, timeout=90):
        assert report["sizes"] == report["expected_sizes"]
        assert report["error"] < FP32
        assert report["loss"] > 0
