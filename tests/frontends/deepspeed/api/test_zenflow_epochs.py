"""ZenFlow's epoch-based column selection counts the batches of the training data given
to `deepspeed.initialize`, as DeepSpeed 0.19.8 reads `len(training_dataloader)`."""

import pytest
import torch
from torch.utils.data import TensorDataset

import shardwise.frontends.deepspeed.api as deepspeed


def config(zenflow: dict) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "zenflow": zenflow}}


def engine_with_data(zenflow: dict, samples: int):
    model = torch.nn.Linear(4, 4)
    data = TensorDataset(torch.randn(samples, 4))
    engine, _, loader, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                training_data=data, config=config(zenflow))
    return engine, loader


def test_epoch_interval_counts_the_loader_batches():
    engine, loader = engine_with_data({"select_strategy": "epoch", "select_interval": 2, "update_interval": 2}, 10)
    assert len(loader) == 5 and engine.zenflow.schedule.select_interval == 10
    engine.destroy()
    engine, _ = engine_with_data({"update_interval": 2}, 10)  # "auto": every epoch
    assert engine.zenflow.schedule.select_interval == 5
    engine.destroy()


def test_an_epoch_shorter_than_the_update_interval_is_refused():
    with pytest.raises(ValueError, match="shorter than update_interval 4"):
        engine_with_data({"select_strategy": "epoch", "select_interval": 1, "update_interval": 4}, 4)
