"""DeepSpeed's `engine.compile()`: the model's repeated blocks run through `torch.compile`
(with the backend and kwargs given), the training equals eager training, `is_compiled`
answers, a second call does nothing; at stage 3 a model with no repeated block is refused
with the reason. With DEEPSPEED_PYTHON, DeepSpeed 0.19.8 runs the same script (backend
"eager": Dynamo traces, nothing is generated) to the same weights."""

from __future__ import annotations

import logging

import pytest
import torch

from shardwise.tools.testing import run_distributed
from tests.frontends.deepspeed.deepspeed_side import deepspeed_trains, needs_deepspeed

TRAIN = """
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.linear = nn.LayerNorm(16), nn.Linear(16, 16)

    def forward(self, x):
        return x + torch.tanh(self.linear(self.norm(x)))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Linear(8, 16), nn.Linear(16, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(3))

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def train(deepspeed, config, compiling):
    torch.manual_seed(0)
    model = Model()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    answers = [engine.is_compiled]
    if compiling:
        engine.compile(backend="eager")
        answers.append(engine.is_compiled)
        engine.compile(backend="eager")  # a second call does nothing
    for step in range(3):
        generator = torch.Generator().manual_seed(step)
        x, y = torch.randn(4, 8, generator=generator), torch.randn(4, 8, generator=generator)
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
    weights = [p.detach().clone() for p in model.parameters()]
    if config["zero_optimization"]["stage"] == 3:
        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            weights = [p.detach().clone() for p in model.parameters()]
    return {"weights": [w.flatten().tolist() for w in weights], "answers": answers}
"""

CONFIGS = {f"stage_{stage}": {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage},
                              "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}} for stage in (0, 3)}


def _runs(rank: int, world_size: int, compiling: bool) -> dict:
    import torch._dynamo

    import shardwise.frontends.deepspeed.api as deepspeed

    scope: dict = {}
    exec(TRAIN, scope)
    runs = {}
    for name, config in CONFIGS.items():
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        runs[name] = scope["train"](deepspeed, config, compiling)
        runs[name]["graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return runs


def _close(mine: list[list[float]], theirs: list[list[float]]) -> bool:
    return all(((torch.tensor(a) - torch.tensor(b)).norm() / torch.tensor(b).norm()).item() < 1e-5
               for a, b in zip(mine, theirs))


def test_compiled_blocks_train_as_eager_ones():
    compiled = run_distributed(_runs, 1, True)[0]
    eager = run_distributed(_runs, 1, False)[0]
    for name in CONFIGS:
        assert compiled[name]["answers"] == [False, True], name
        assert compiled[name]["graphs"] >= 1 and eager[name]["graphs"] == 0, name
        assert _close(compiled[name]["weights"], eager[name]["weights"]), name


def _refused_without_blocks(rank: int, world_size: int) -> str:
    import shardwise.frontends.deepspeed.api as deepspeed

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=CONFIGS["stage_3"])
    with pytest.raises(ValueError, match="compiles each repeated block of the model") as refused:
        engine.compile()
    return str(refused.value)


def test_stage_3_needs_repeated_blocks():
    run_distributed(_refused_without_blocks, 1)


def _backend_in_kwargs(rank: int, world_size: int) -> list[str]:
    import shardwise.frontends.deepspeed.api as deepspeed

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("shardwise").addHandler(handler)
    scope: dict = {}
    exec(TRAIN, scope)
    model = scope["Model"]()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=CONFIGS["stage_0"])
    engine.compile(backend="eager", compile_kwargs={"backend": "inductor"})
    return records


def test_a_backend_in_the_kwargs_is_overridden_with_deepspeeds_warning():
    (records,) = run_distributed(_backend_in_kwargs, 1)
    assert any("will be overridden" in record for record in records)


@needs_deepspeed
def test_deepspeed_compiles_and_trains_alike():
    ours = run_distributed(_runs, 1, True)[0]
    theirs = deepspeed_trains(TRAIN, CONFIGS, "train(deepspeed, config, True)")
    for name, run in ours.items():
        assert run["answers"] == theirs[name]["answers"], name
        assert _close(run["weights"], theirs[name]["weights"]), name
