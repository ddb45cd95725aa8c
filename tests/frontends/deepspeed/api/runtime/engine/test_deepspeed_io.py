"""`engine.deepspeed_io`: the loaders DeepSpeed scripts build from their engine (training,
dev and test sets) read the batches DeepSpeed 0.19.8's would: the "train" route shuffled
as DeepSpeed's DistributedSampler (seed 0), "eval" in order, each rank its interleaved
share, through initialize's `collate_fn` unless given another. With DEEPSPEED_PYTHON set,
the slow test asks DeepSpeed for the same loaders' batches."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, SequentialSampler, TensorDataset

import shardwise.frontends.deepspeed.api as deepspeed
from shardwise.tools.testing import run_distributed
from tests.frontends.deepspeed.deepspeed_side import ONE_RANK, deepspeed_json

CONFIG = {"train_micro_batch_size_per_gpu": 3, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}


def _values(batch: list) -> list[float]:
    """initialize's collate_fn: the samples' values as a list."""
    return [sample[0].item() for sample in batch]


def _doubled(batch: list) -> list[float]:
    """A collate_fn given to deepspeed_io, which wins over initialize's."""
    return [2 * sample[0].item() for sample in batch]


def _loaders(samples: int) -> dict[str, list]:
    """Every loader's batches, as the DeepSpeed script below reads its own."""
    model = torch.nn.Linear(4, 2)
    data = TensorDataset(torch.arange(float(samples)).unsqueeze(1))
    engine, _, loader, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=CONFIG,
                                                training_data=data, collate_fn=_values)
    try:
        return {"initialize": list(loader), "train": list(engine.deepspeed_io(data)),
                "eval": list(engine.deepspeed_io(data, route="eval", batch_size=4)),
                "sampler": list(engine.deepspeed_io(data, collate_fn=_doubled, batch_size=4,
                                                    data_sampler=SequentialSampler(data)))}
    finally:
        engine.destroy()


def test_the_routes_read_deepspeeds_orders_through_initializes_collate_fn():
    data = TensorDataset(torch.arange(10.0).unsqueeze(1))
    shuffled = [_values(batch) for batch in DataLoader(data, batch_size=3, collate_fn=lambda b: b,
                                                       sampler=DistributedSampler(data, num_replicas=1, rank=0))]
    assert shuffled != [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0], [6.0, 7.0, 8.0], [9.0]]  # it is shuffled
    assert _loaders(10) == {"initialize": shuffled, "train": shuffled,
                            "eval": [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0], [8.0, 9.0]],
                            "sampler": [[0.0, 2.0, 4.0, 6.0], [8.0, 10.0, 12.0, 14.0], [16.0, 18.0]]}


def test_the_train_route_drives_the_throughput_timer_and_keeps_no_position_of_a_scripts_sampler():
    model = torch.nn.Linear(1, 1)
    data = TensorDataset(torch.arange(6.0).unsqueeze(1))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=CONFIG)
    try:
        train, evaluation = engine.deepspeed_io(data), engine.deepspeed_io(data, route="eval")
        assert (train.tput_timer, evaluation.tput_timer) == (engine.tput_timer, None)
        assert isinstance(train.data_sampler, DistributedSampler) and train.data_sampler.shuffle is True
        assert evaluation.data_sampler.shuffle is False
        assert engine.data_position is None  # a loader the script builds is the script's
        own = engine.deepspeed_io(data, data_sampler=SequentialSampler(data))
        with pytest.raises(TypeError, match="the script's own sampler \\(SequentialSampler\\)"):
            own.state_dict()
    finally:
        engine.destroy()


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(range(3))


def test_what_deepspeed_cannot_sample_is_refused_with_the_reason():
    model = torch.nn.Linear(1, 1)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=CONFIG)
    try:
        with pytest.raises(ValueError, match="map-style torch Dataset .* got _Stream"):
            engine.deepspeed_io(_Stream())
        with pytest.raises(ValueError, match="map-style torch Dataset .* got object"):
            engine.deepspeed_io(object())
        with pytest.raises(ValueError, match="route='encode'"):
            engine.deepspeed_io(TensorDataset(torch.zeros(2, 1)), route="encode")
        assert engine.is_map_style_dataset([1, 2]) and engine.is_iterable_style_dataset(_Stream())
    finally:
        engine.destroy()


def _shares(rank: int, world_size: int) -> dict[str, list]:
    model = torch.nn.Linear(1, 1)
    data = TensorDataset(torch.arange(8.0).unsqueeze(1))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=CONFIG,
                                      collate_fn=_values)
    try:
        return {"train": sum(engine.deepspeed_io(data), []), "eval": sum(engine.deepspeed_io(data, route="eval"), [])}
    finally:
        engine.destroy()


def test_each_data_parallel_rank_reads_its_interleaved_share():
    first, second = run_distributed(_shares, 2)
    order = [index for pair in zip(first["train"], second["train"]) for index in pair]
    assert sorted(order) == [float(index) for index in range(8)]
    assert (first["eval"], second["eval"]) == ([0.0, 2.0, 4.0, 6.0], [1.0, 3.0, 5.0, 7.0])


DEEPSPEED_LOADERS = """
import json, sys, torch, deepspeed
from torch.utils.data import SequentialSampler, TensorDataset
""" + ONE_RANK + """
deepspeed.init_distributed()
def _values(batch):
    return [sample[0].item() for sample in batch]
def _doubled(batch):
    return [2 * sample[0].item() for sample in batch]
samples, config = int(sys.argv[1]), json.loads(sys.argv[2])
model = torch.nn.Linear(4, 2)
data = TensorDataset(torch.arange(float(samples)).unsqueeze(1))
engine, _, loader, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                            training_data=data, collate_fn=_values)
print(json.dumps({"initialize": list(loader), "train": list(engine.deepspeed_io(data)),
                  "eval": list(engine.deepspeed_io(data, route="eval", batch_size=4)),
                  "sampler": list(engine.deepspeed_io(data, collate_fn=_doubled, batch_size=4,
                                                      data_sampler=SequentialSampler(data)))}))
"""


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("DEEPSPEED_PYTHON"), reason="set DEEPSPEED_PYTHON to an interpreter with "
                    "DeepSpeed 0.19.8 to compare with it")
def test_deepspeed_reads_the_same_batches():
    assert deepspeed_json(DEEPSPEED_LOADERS, "10", json.dumps(CONFIG), timeout=600) == _loaders(10)
