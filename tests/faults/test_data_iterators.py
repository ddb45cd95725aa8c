"""A data iterator shorter than one batch of micro-batches is named, not an empty
StopIteration, and nothing of the batch is trained (reliability issue 30)."""

import pytest
import torch
from torch import nn

import shardwise.frontends.deepspeed.api as deepspeed
from shardwise.frontends.deepspeed.api.pipe import PipelineModule


def test_train_batch_with_too_few_micro_batches_says_how_many_it_needs():
    torch.manual_seed(0)
    model = PipelineModule(layers=[nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)], num_stages=1,
                           loss_fn=nn.CrossEntropyLoss())
    engine, *_ = deepspeed.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    short = [(torch.randn(2, 4), torch.tensor([0, 1]))] * 2
    with pytest.raises(ValueError, match=r"the data iterator ran out after 2 micro-batch\(es\), but one batch runs "
                                         r"3 \(pipeline_parallel.micro_batches, default gradient_accumulation_steps\)"):
        engine.train_batch(iter(short))
    assert engine.global_steps == 0 and engine.micro_steps == 0  # no part of the batch was trained
    engine.train_batch(iter(short * 2))
    assert engine.global_steps == 1
