"""DeepSpeed's PipelineEngine's data methods on 2 pipeline stages: `set_dataloader(loader)`
then `train_batch()` without an iterator reads the loader; `set_batch_fn(fn)` passes each
micro-batch through `fn` (Megatron-DeepSpeed's way of building pipeline inputs); and after
`reset_activation_shape()` a step of another micro-batch size trains (shardwise's pipeline
caches no shapes). Each gives the losses of feeding the same batches directly, exactly."""

from __future__ import annotations

import torch
from torch import nn

import shardwise.frontends.deepspeed.api as deepspeed
from shardwise.frontends.deepspeed.api.pipe import PipelineModule
from shardwise.tools.testing import run_distributed
from tests.runtime.parallel.test_pipeline_sequential import (MICRO_BATCH, MICRO_BATCHES, build_layers, global_batches,
                                                             micro_batches)


def _engine():
    model = PipelineModule(layers=build_layers(), loss_fn=nn.CrossEntropyLoss(), num_stages=2)
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": MICRO_BATCHES,
              "gradient_clipping": 1.0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _doubled(batch):
    images, labels = batch
    return images * 2, labels


def _train(rank: int, world_size: int, how: str) -> list[float]:
    engine = _engine()
    steps = [micro_batches(images, labels, MICRO_BATCH) for images, labels in global_batches(1)]
    try:
        if how == "direct":
            return [engine.train_batch(iter([_doubled(batch) for batch in step])).item() for step in steps]
        engine.set_batch_fn(_doubled)
        if how == "loader":
            engine.set_dataloader([batch for step in steps for batch in step])
            return [engine.train_batch().item() for _ in steps]
        losses = [engine.train_batch(iter(steps[0])).item()]
        engine.reset_activation_shape()  # then micro-batches of one sample
        halves = [(images[:1], labels[:1]) for images, labels in steps[1]]
        return losses + [engine.train_batch(iter(halves)).item()]
    finally:
        engine.destroy()


def test_set_dataloader_and_set_batch_fn_feed_the_batches_given_directly():
    direct = run_distributed(_train, 2, "direct", timeout=180)
    assert run_distributed(_train, 2, "loader", timeout=180) == direct
    reshaped = run_distributed(_train, 2, "reset", timeout=180)
    assert reshaped[0][0] == direct[0][0]
    assert all(torch.isfinite(torch.tensor(losses)).all() for losses in reshaped)
