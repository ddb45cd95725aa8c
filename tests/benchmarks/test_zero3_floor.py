"""The no-communication floor of benchmarks/zero3_vs_fsdp2_deepspeed.py does a ZeRO-3
rank's own work: the rank's 1/N of the flattened gradients, clipped, stepped by fused
AdamW on a 1/N shard (issue 27 item 2). Checked in one process on a tiny model."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import zero3_vs_fsdp2_deepspeed as bench  # noqa: E402


class TinyLoss(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(3, 5)
        self.second = torch.nn.Linear(5, 2)

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.second(torch.tanh(self.first(inputs))), targets)


@pytest.mark.parametrize("rank", [0, 1])
def test_floor_step_takes_the_ranks_gradient_chunk_and_clips_it(rank: int) -> None:
    torch.manual_seed(0)
    model = TinyLoss()
    args = argparse.Namespace(clip=0.01, lr=1e-3)
    step = bench.FloorStep(model, args, rank, world_size=2)
    inputs, targets = torch.randn(4, 3), torch.randn(4, 2)
    reference = TinyLoss()
    reference.load_state_dict(model.state_dict())
    reference(inputs, targets).backward()
    flat = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
    chunk = flat[rank * step.shard_numel : (rank + 1) * step.shard_numel]
    assert step.shard_numel == -(-flat.numel() // 2)

    step.optimizer.step = lambda: None  # look at the clipped gradient before AdamW uses it
    loss = step(inputs, targets)

    with torch.no_grad():
        assert loss == pytest.approx(float(reference(inputs, targets)), rel=1e-6)
    expected = chunk * min(1.0, args.clip / (float(chunk.norm()) + 1e-6))
    torch.testing.assert_close(step.shard.grad[: chunk.numel()], expected, rtol=1e-5, atol=1e-7)
    assert all(float(p.grad.abs().sum()) == 0 for p in model.parameters())  # zeroed for the next step


def test_floor_step_updates_the_shard_with_fused_adamw() -> None:
    torch.manual_seed(0)
    step = bench.FloorStep(TinyLoss(), argparse.Namespace(clip=1.0, lr=1e-2), rank=0, world_size=2)
    step(torch.randn(4, 3), torch.randn(4, 2))
    assert step.optimizer.defaults["fused"] and float(step.shard.detach().abs().sum()) > 0
