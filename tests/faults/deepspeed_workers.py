"""Rank functions for tests/faults/test_deepspeed_arguments.py: a DeepSpeed-API engine given
a bad checkpoint argument on some or all ranks. Each returns the error it raised."""

from __future__ import annotations

import os
import time

import torch
from torch import nn

import shardwise.frontends.deepspeed.api as deepspeed


def _engine(tag_validation: str = "Warn"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": 2}, "checkpoint": {"tag_validation": tag_validation}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    engine.backward(engine(torch.randn(2, 4)).sum())
    engine.step()
    return engine


def call_with(rank: int, world_size: int, call: str, directory: str, case: str,
              tag_validation: str = "Warn") -> tuple[str, str, float, bool]:
    """`engine.<call>` with the argument `case` names (on rank 1 only for the "rank1_*"
    cases); returns (error class, message, seconds the call took, whether it is an AssertionError)."""
    engine = _engine(tag_validation)
    arguments = {
        "empty": {"tag": None, "folder": ""},
        "none": {"tag": None, "folder": None},
        "not_a_path": {"tag": None, "folder": 5},
        "rank1_none": {"tag": None, "folder": None if rank == 1 else directory},
        "folder_per_rank": {"tag": None, "folder": f"{directory}/run-{rank}"},
        "tag_per_rank": {"tag": f"tag-{rank}", "folder": directory},
        "bad_tag": {"tag": "../up" if rank == 1 else "fine", "folder": directory},
    }[case]
    started = time.monotonic()
    try:
        getattr(engine, call)(arguments["folder"], tag=arguments["tag"])
    except Exception as error:  # the test asserts on the class and the message
        return type(error).__name__, str(error), time.monotonic() - started, isinstance(error, AssertionError)
    return "none", "", time.monotonic() - started, False


def save_16bit_with(rank: int, world_size: int, directory: str, case: str) -> tuple[str, str, float, list[str]]:
    """`engine.save_16bit_model` with the bad argument `case` names (on rank 1 only for the
    "rank1_*" cases); returns (error class, message, seconds, files left in `directory`)."""
    engine = _engine()
    folder, name = {
        "empty": ("", "model.bin"),
        "rank1_none": (None if rank == 1 else directory, "model.bin"),
        "rank1_bad_name": (directory, f"{directory}/nested/model.bin" if rank == 1 else "model.bin"),
        "not_a_name": (directory, 7),
    }[case]
    started = time.monotonic()
    try:
        engine.save_16bit_model(folder, name)
    except Exception as error:  # the test asserts on the class and the message
        return type(error).__name__, str(error), time.monotonic() - started, sorted(os.listdir(directory))
    return "none", "", time.monotonic() - started, sorted(os.listdir(directory))
