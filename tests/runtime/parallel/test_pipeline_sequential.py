"""A model given as a list of layers (SequentialStages, DeepSpeed's PipelineModule form)
split into pipeline stages trains exactly like one process on the same global batch:
convolutions, a function in the list (flatten), layers that pass a tuple of tensors (one
of which takes no gradient), activations whose shapes change between stages (sent with a
header), and recomputation every k layers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardwise
from shardwise.runtime.parallel.pipeline import SequentialStages
from shardwise.tools.testing import run_distributed
from tests.runtime.zero.workers import relative_error

MICRO_BATCH, MICRO_BATCHES, STEPS = 2, 4, 3


class WithMask(nn.Module):
    """Returns (features, mask): a tuple between layers, the mask carrying no gradient."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, (x > 0).float()


class Masked(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x, mask = pair
        return torch.tanh(self.linear(x)) * mask + x, mask


def build_layers() -> list:
    torch.manual_seed(7)
    return [
        nn.Conv2d(3, 8, kernel_size=3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 8, kernel_size=3, padding=1), nn.ReLU(),
        lambda x: torch.flatten(x, 1),
        nn.Linear(8 * 4 * 4, 32), WithMask(), Masked(32), Masked(32),
        lambda pair: pair[0],
        nn.Linear(32, 10),
    ]


def global_batches(data_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per step, the global batch: MICRO_BATCHES x data_size x MICRO_BATCH images and labels."""
    generator = torch.Generator().manual_seed(11)
    steps = []
    for _ in range(STEPS):
        images = torch.randn(MICRO_BATCHES * data_size * MICRO_BATCH, 3, 8, 8, generator=generator)
        steps.append((images, torch.randint(0, 10, (len(images),), generator=generator)))
    return steps


def micro_batches(images: torch.Tensor, labels: torch.Tensor, rows: int, data_size: int = 1, rank: int = 0) -> list:
    """Micro-batch i of data rank d: rows [(i * D + d) * rows, ...) of the global batch."""
    cuts = [slice((i * data_size + rank) * rows, (i * data_size + rank + 1) * rows) for i in range(MICRO_BATCHES)]
    return [(images[cut], labels[cut]) for cut in cuts]


def config(pipeline: int, stage: int, split_points: list[int] | None = None) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": MICRO_BATCHES,
            "gradient_clipping": 1.0, "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "pipeline_parallel": {"size": pipeline, "split_points": split_points}}


def train(rank: int, world_size: int, pipeline: int, stage: int, interval: int, split_points: list[int] | None) -> dict:
    model = SequentialStages(build_layers(), loss_fn=nn.CrossEntropyLoss(), checkpoint_interval=interval)
    engine = shardwise.initialize(model, config(pipeline, stage, split_points))
    data_rank, data_size = engine.comm.rank, engine.comm.size
    losses = [engine.train_batch(iter(micro_batches(images, labels, MICRO_BATCH, data_size, data_rank))).item()
              for images, labels in global_batches(data_size)]
    params = {name: param.detach().clone() for name, param in engine.module.named_parameters()}
    engine.destroy()
    return {"losses": losses, "params": params}


def train_reference(rank: int, world_size: int, data_size: int) -> dict:
    """One process, the whole global batch per step, as gradient accumulation over the
    same micro-batch boundaries (each micro-batch holds every data rank's rows)."""
    model = SequentialStages(build_layers())
    engine = shardwise.initialize(model, config(1, 0) | {"train_micro_batch_size_per_gpu": MICRO_BATCH * data_size})
    losses = []
    for images, labels in global_batches(data_size):
        step_losses = []
        for inputs, targets in micro_batches(images, labels, MICRO_BATCH * data_size):
            loss = nn.functional.cross_entropy(engine(inputs), targets)
            engine.backward(loss)
            engine.step()
            step_losses.append(loss.item())
        losses.append(sum(step_losses) / len(step_losses))
    params = {name: param.detach().clone() for name, param in engine.module.named_parameters()}
    engine.destroy()
    return {"losses": losses, "params": params}


@pytest.mark.parametrize(("world_size", "pipeline", "stage", "interval", "split_points"),
                         [(2, 2, 1, 0, [9]), (4, 2, 2, 2, None)],
                         ids=["pp2-tuple-between-stages", "pp2-dp2-zero2-recompute2"])
def test_sequential_stages_equal_one_process(world_size, pipeline, stage, interval, split_points):
    """[9]: the stages meet between the two Masked layers, so a tuple crosses; by
    parameters they meet after the first Linear, where the shape changed from 4-d."""
    data_size = world_size // pipeline
    results = run_distributed(train, world_size, pipeline, stage, interval, split_points, timeout=240)
    want = run_distributed(train_reference, 1, data_size, timeout=120)[0]
    assert len({round(loss, 4) for loss in want["losses"]}) == STEPS  # it trains
    assert_stages_equal_reference(results, want)


def evaluate_forward_only(rank: int, world_size: int) -> dict:
    """An engine without an optimizer (an evaluation job) split over 2 stages."""
    model = SequentialStages(build_layers(), loss_fn=nn.CrossEntropyLoss())
    engine = shardwise.initialize(model, {"train_micro_batch_size_per_gpu": MICRO_BATCH,
                                          "gradient_accumulation_steps": MICRO_BATCHES,
                                          "pipeline_parallel": {"size": 2, "split_points": [9]}})
    images, labels = global_batches(1)[0]
    loss = engine.eval_batch(iter(micro_batches(images, labels, MICRO_BATCH))).item()
    try:
        engine.train_batch(iter(micro_batches(images, labels, MICRO_BATCH)))
    except RuntimeError as error:
        return {"loss": loss, "refused": str(error)}
    return {"loss": loss, "refused": None}


def test_forward_only_pipeline_evaluates_like_one_process():
    images, labels = global_batches(1)[0]
    model = SequentialStages(build_layers())
    with torch.no_grad():
        want = sum(nn.functional.cross_entropy(model(x), y).item()
                   for x, y in micro_batches(images, labels, MICRO_BATCH)) / MICRO_BATCHES
    for result in run_distributed(evaluate_forward_only, 2, timeout=120):
        assert abs(result["loss"] - want) < 1e-5 * want
        assert result["refused"] is not None and "only runs forward" in result["refused"]


def assert_stages_equal_reference(results: list[dict], want: dict) -> None:
    """Every stage's losses equal the reference's, and the stages' parameters together equal
    its parameters (fp32, 1e-5)."""
    for result in results:
        for got, expected in zip(result["losses"], want["losses"], strict=True):
            assert abs(got - expected) / expected < 1e-5, (result["losses"], want["losses"])
    merged = {}
    for result in results:
        merged.update(result["params"])
    assert set(merged) == set(want["params"])
    for name, expected in want["params"].items():
        assert relative_error(merged[name], expected) < 1e-5, name
