"""`ignore_unused_parameters: false`: a trainable parameter that got no gradient in an
accumulation window raises at step(), on every rank, naming it, where DeepSpeed 0.19.8
raises (stages 1-2, optimizer offloaded to the CPU); elsewhere its gradient counts as zero."""

import pytest
import torch
from torch import nn

import shardwise
from shardwise.runtime.zero.gradients import UnusedParametersError
from shardwise.tools.testing import run_distributed


class PartlyUsed(nn.Module):
    """`spare` takes part in the loss only when asked."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.used = nn.Linear(4, 4)
        self.spare = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, use_spare: bool) -> torch.Tensor:
        out = self.used(x)
        return (out + self.spare(x) if use_spare else out).square().mean()


def config(stage: int, ignore: bool, offload: bool = True) -> dict:
    zero = {"stage": stage, "ignore_unused_parameters": ignore}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "zero_optimization": zero}


def _train_window(engine, uses_spare: list[bool]) -> str:
    """One accumulation window of two micro-batches; what the boundary's step raised, or ""."""
    for micro, use_spare in enumerate(uses_spare):
        engine.backward(engine(torch.full((2, 4), 0.5 + micro), use_spare))
        try:
            engine.step()
        except AssertionError as error:  # what DeepSpeed raises, and its own test expects
            assert isinstance(error, UnusedParametersError) and micro == 1, error
            return str(error)
    return ""


def _windows(rank: int, world_size: int, stage: int) -> dict[str, str]:
    results = {}
    engine = shardwise.initialize(PartlyUsed(), config(stage, ignore=False))
    results["spare used in one micro-batch"] = _train_window(engine, [False, True])
    results["spare used on rank 0 only"] = _train_window(engine, [rank == 0, False])
    results["spare unused"] = _train_window(engine, [False, False])
    engine.destroy()
    engine = shardwise.initialize(PartlyUsed(), config(stage, ignore=True))
    results["spare unused, ignored"] = _train_window(engine, [False, False])
    engine.destroy()
    return results


@pytest.mark.parametrize("stage", [1, 2])
def test_a_parameter_without_gradient_raises_on_every_rank_naming_it(stage):
    for results in run_distributed(_windows, 2, stage, timeout=180):
        assert results["spare used in one micro-batch"] == ""
        assert results["spare used on rank 0 only"] == ""  # another rank's gradient counts
        message = results["spare unused"]
        assert message.startswith("2 trainable parameter(s) got no gradient in this accumulation window on any "
                                  "rank: spare."), message
        assert "spare.weight" in message and "spare.bias" in message and "used." not in message
        assert "ignore_unused_parameters" in message  # what DeepSpeed's own test looks for
        assert results["spare unused, ignored"] == ""
