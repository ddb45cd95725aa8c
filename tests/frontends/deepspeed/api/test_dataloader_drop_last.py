"""`dataloader_drop_last`: the loader deepspeed.initialize(training_data=...) builds drops
the last incomplete micro-batch, and its sampler the samples that do not divide among the
data-parallel ranks, as DeepSpeed's loader does (DistributedSampler and DataLoader both get
drop_last)."""

import pytest
import torch
from torch.utils.data import TensorDataset

import shardwise.frontends.deepspeed.api as deepspeed
from shardwise.tools.testing import run_distributed


def batches(samples: int, drop_last: bool) -> list[int]:
    """The sizes of the micro-batches this rank's loader yields for `samples` samples."""
    model = torch.nn.Linear(3, 1)
    config = {"train_micro_batch_size_per_gpu": 2, "dataloader_drop_last": drop_last,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    data = TensorDataset(torch.randn(samples, 3), torch.randn(samples, 1))
    engine, _, loader, _ = deepspeed.initialize(model=model, config=config, training_data=data)
    sizes = [len(inputs) for inputs, _ in loader]
    engine.destroy()
    return sizes


@pytest.mark.parametrize(("drop_last", "expected"), [(True, [2, 2]), (False, [2, 2, 1])])
def test_five_samples_in_micro_batches_of_two(drop_last, expected):
    assert batches(5, drop_last) == expected


def two_ranks(rank: int, world_size: int, drop_last: bool) -> list[int]:
    return batches(7, drop_last)


@pytest.mark.parametrize(("drop_last", "expected"), [(True, [2]), (False, [2, 2])])
def test_the_sampler_drops_what_does_not_divide_among_ranks(drop_last, expected):
    """7 samples on 2 ranks: 3 each with drop_last (one whole micro-batch), else 4 each
    (the sampler repeats a sample to even them out)."""
    assert run_distributed(two_ranks, 2, drop_last) == [expected, expected]
