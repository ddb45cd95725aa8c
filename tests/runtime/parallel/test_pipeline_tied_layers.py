"""DeepSpeed's `TiedLayerSpec` in a `PipelineModule`: an embedding used again as the output
layer (through `forward_fn`) by the last stage, and a block used twice in the middle.
Split over stages, every use's gradient reaches the one owner, so training equals one
process on the same global batch, at pp=2, pp=3 and pp=2 x dp=2 with ZeRO-2."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardwise
from shardwise.frontends.deepspeed.api.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from shardwise.tools.testing import run_distributed
from tests.runtime.zero.workers import relative_error

VOCAB, WIDTH, SEQ = 16, 8, 6
MICRO_BATCH, MICRO_BATCHES, STEPS = 2, 4, 3


class Embedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.word_embeddings = nn.Embedding(VOCAB, WIDTH)
        self.scale = nn.Parameter(torch.ones(WIDTH))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.word_embeddings(ids) * self.scale


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


def output_logits(embedding: Embedding, hidden: torch.Tensor) -> torch.Tensor:
    return hidden @ embedding.word_embeddings.weight.t()


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def build(stages: int) -> PipelineModule:
    torch.manual_seed(3)
    specs = [TiedLayerSpec("embed", Embedding, tied_weight_attr="word_embeddings.weight"),
             LayerSpec(Block), TiedLayerSpec("shared_block", Block), LayerSpec(Block),
             TiedLayerSpec("shared_block", Block), LayerSpec(Block),
             TiedLayerSpec("embed", Embedding, forward_fn=output_logits, tied_weight_attr="word_embeddings.weight")]
    return PipelineModule(specs, num_stages=stages, loss_fn=loss_fn, partition_method="uniform"
                          if stages == 1 else "parameters")


def batches(data_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(5)
    rows = MICRO_BATCHES * data_size * MICRO_BATCH
    return [(torch.randint(0, VOCAB, (rows, SEQ), generator=generator),
             torch.randint(0, VOCAB, (rows, SEQ), generator=generator)) for _ in range(STEPS)]


def micro_batches(ids, labels, rows: int, data_size: int = 1, rank: int = 0) -> list:
    cuts = [slice((i * data_size + rank) * rows, (i * data_size + rank + 1) * rows) for i in range(MICRO_BATCHES)]
    return [(ids[cut], labels[cut]) for cut in cuts]


def config(pipeline: int, stage: int, micro_batch: int) -> dict:
    return {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": MICRO_BATCHES,
            "gradient_clipping": 1.0, "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": 2e-2}}, "pipeline_parallel": {"size": pipeline}}


def train(rank: int, world_size: int, pipeline: int, stage: int) -> dict:
    engine = shardwise.initialize(build(pipeline), config(pipeline, stage, MICRO_BATCH))
    data_rank, data_size = engine.comm.rank, engine.comm.size
    losses = [engine.train_batch(iter(micro_batches(ids, labels, MICRO_BATCH, data_size, data_rank))).item()
              for ids, labels in batches(data_size)]
    shared = engine.pipeline.layout.shared
    return {"losses": losses, "params": {name: p.detach().clone() for name, p in engine.module.named_parameters()},
            "receives": sorted(path for paths in (shared.receives.values() if shared else ()) for path, _ in paths)}


def train_reference(rank: int, world_size: int, data_size: int) -> dict:
    """One process with the whole global batch, as accumulation over the same micro-batch
    boundaries: the shared modules are one object each."""
    engine = shardwise.initialize(build(1), config(1, 0, MICRO_BATCH * data_size))
    losses = []
    for ids, labels in batches(data_size):
        step = []
        for inputs, targets in micro_batches(ids, labels, MICRO_BATCH * data_size):
            loss = loss_fn(engine(inputs), targets)
            engine.backward(loss)
            engine.step()
            step.append(loss.item())
        losses.append(sum(step) / len(step))
    return {"losses": losses, "params": {name: p.detach().clone() for name, p in engine.module.named_parameters()}}


@pytest.mark.parametrize(("world_size", "pipeline", "stage"), [(2, 2, 1), (3, 3, 0), (4, 2, 2)],
                         ids=["pp2-zero1", "pp3", "pp2-dp2-zero2"])
def test_tied_layers_across_stages_equal_one_process(world_size, pipeline, stage):
    want = run_distributed(train_reference, 1, world_size // pipeline, timeout=120)[0]
    results = run_distributed(train, world_size, pipeline, stage, timeout=240)
    assert len({round(loss, 4) for loss in want["losses"]}) == STEPS
    merged = {}
    for result in results:
        for got, expected in zip(result["losses"], want["losses"], strict=True):
            assert abs(got - expected) / expected < 1e-5, (result["losses"], want["losses"])
        merged.update(result["params"])
    assert set(merged) == set(want["params"])  # each shared parameter once, under its first place's name
    received = [path for result in results for path in result["receives"]]
    assert "layers.6.module.word_embeddings.weight" in received  # the output layer's embedding crossed stages
    for name, expected in want["params"].items():
        assert relative_error(merged[name], expected) < 1e-5, name
