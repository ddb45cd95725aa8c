"""runtime/engine_protocol.py: every engine a front end builds (the runtime's `Engine`,
`shardwise.initialize`'s `ConfiguredEngine`, `deepspeed.initialize`'s `DeepSpeedEngine`)
has every member of the protocol that checkpoints, the pipeline runner and the front ends
use, of the declared type, defined by the engine itself (not passed through to the
model), and its methods take the protocol's arguments."""

from __future__ import annotations

import inspect
import typing
from typing import Any

import pytest
import torch
from torch import nn

import shardwise
import shardwise.frontends.deepspeed.api as deepspeed
from shardwise.runtime.engine import Policies
from shardwise.runtime.engine_protocol import EngineProtocol
from tests.runtime.zero.workers import build_model

CONFIG = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": 3}}


def protocol_mismatches(engine: object) -> list[str]:
    """What `engine` lacks of the protocol, or has of another type or shape."""
    wrong = []
    hints = typing.get_type_hints(EngineProtocol)
    for name, declared in hints.items():
        if not _defined_by_engine(engine, name):
            wrong.append(f"{name}: not an attribute of the engine")
        elif declared is not Any and not isinstance(getattr(engine, name), declared):
            wrong.append(f"{name}: {type(getattr(engine, name)).__name__}, declared {declared}")
    methods = [name for name, value in vars(EngineProtocol).items()
               if inspect.isfunction(value) and not name.startswith("_")]
    for name in methods:
        if not _defined_by_engine(engine, name) or not callable(getattr(engine, name)):
            wrong.append(f"{name}(): not a method of the engine")
            continue
        wanted = inspect.signature(getattr(EngineProtocol, name)).parameters
        given = inspect.signature(getattr(engine, name)).parameters
        for parameter in list(wanted.values())[1:]:  # after self
            if parameter.name not in given or given[parameter.name].kind != parameter.kind:
                wrong.append(f"{name}(): no {parameter.kind.description} parameter {parameter.name!r}")
        extra = [p.name for p in given.values() if p.name not in wanted and p.default is inspect.Parameter.empty
                 and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if extra:
            wrong.append(f"{name}(): needs {extra}, which the protocol does not pass")
    return wrong


def _defined_by_engine(engine: object, name: str) -> bool:
    """On the instance or its class, not found by `Engine.__getattr__` on the model."""
    if name in vars(engine) or name in getattr(engine, "_modules", {}):
        return True
    return any(name in vars(klass) for klass in type(engine).__mro__ if klass not in (object, nn.Module))


def _runtime_engine() -> shardwise.Engine:
    model = build_model("gpt")
    return shardwise.build_engine(model, Policies(), optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def _engines() -> dict[str, Any]:
    return {
        "Engine": _runtime_engine,
        "ConfiguredEngine": lambda: shardwise.initialize(build_model("gpt"), CONFIG),
        "DeepSpeedEngine": lambda: deepspeed.initialize(model=build_model("gpt"), config=CONFIG)[0],
        "forward only": lambda: shardwise.initialize(build_model("gpt"), {"train_micro_batch_size_per_gpu": 2}),
    }


@pytest.mark.parametrize("kind", list(_engines()))
def test_every_engine_has_the_protocol(kind):
    engine = _engines()[kind]()
    try:
        assert protocol_mismatches(engine) == []
        assert isinstance(engine, EngineProtocol)
    finally:
        engine.destroy()


def test_the_check_sees_a_missing_member_a_wrong_type_and_a_wrong_signature():
    """Planted: an engine whose counter is a float, whose `get_lr` is gone, and whose
    `step_after_schedule` wants another argument."""
    engine = _runtime_engine()
    try:
        engine.global_steps = 0.0
        engine.get_lr = None
        engine.step_after_schedule = lambda micro_batches, chunks: None
        assert protocol_mismatches(engine) == [
            "global_steps: float, declared <class 'int'>",
            "get_lr(): not a method of the engine",
            "step_after_schedule(): needs ['chunks'], which the protocol does not pass",
        ]
    finally:
        engine.destroy()
