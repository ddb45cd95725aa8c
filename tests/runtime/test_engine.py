"""The engine's own errors: contradictory arguments, and failures on other ranks that
must surface as clear errors within the collective timeout, never as hangs."""

import os
import time

import pytest
import torch

import shardwise
from shardwise.frontends.deepspeed.config import ConfigError
from shardwise.models import GPT
from shardwise.tools.testing import DistributedTestError, run_distributed
from tests.runtime.zero.workers import build_model, global_batch

BASE = {"train_micro_batch_size_per_gpu": 2}
ADAMW = {"type": "AdamW", "params": {"lr": 1e-3}}


def test_optimizer_in_both_places_is_rejected():
    model = build_model("gpt")
    with pytest.raises(ValueError, match="keep one of them"):
        shardwise.initialize(model, {**BASE, "optimizer": ADAMW}, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def test_scheduler_without_optimizer_is_rejected():
    config = {**BASE, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}}
    with pytest.raises(ValueError, match="scheduler without an optimizer"):
        shardwise.initialize(build_model("gpt"), config)


def test_scheduler_in_both_places_is_rejected():
    config = {**BASE, "optimizer": ADAMW, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}}
    with pytest.raises(ValueError, match="lr_scheduler was passed"):
        shardwise.initialize(build_model("gpt"), config, lr_scheduler=lambda optimizer: None)


def test_parameter_outside_the_optimizer_is_named():
    model = build_model("gpt")
    optimizer = torch.optim.SGD(list(model.parameters())[1:], lr=0.1)
    with pytest.raises(ValueError, match="parameter wte.weight requires grad but is in no param group"):
        shardwise.initialize(model, BASE, optimizer=optimizer)


def test_meta_model_needs_stage_3():
    with torch.device("meta"):
        model = GPT(build_model("gpt").config)
    with pytest.raises(ValueError, match="only ZeRO stage 3"):
        shardwise.initialize(model, {**BASE, "optimizer": ADAMW, "zero_optimization": {"stage": 2}})


def test_bad_config_key_is_named_before_anything_runs():
    with pytest.raises(ConfigError, match="zero_optimization.stgae"):
        shardwise.initialize(build_model("gpt"), {**BASE, "optimizer": ADAMW, "zero_optimization": {"stgae": 2}})


def test_config_scheduler_and_optimizer_are_built():
    config = {
        **BASE, "optimizer": ADAMW,
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 4, "warmup_type": "linear"}},
    }
    engine = shardwise.initialize(build_model("gpt"), config)
    assert isinstance(engine.optimizer.optimizer, torch.optim.AdamW)
    lrs = []
    for step in range(3):
        x, y = global_batch(step, 2)
        engine.backward(engine(x, y))
        engine.step()
        lrs.append(engine.get_lr()[0])
    assert lrs == pytest.approx([0.0, 2.5e-4, 5e-4])  # DeepSpeed's: iteration 0 is the minimum


def _stall_worker(rank: int, world_size: int, how: str) -> None:
    model = build_model("gpt")
    config = {**BASE, "zero_optimization": {"stage": 2, "reduce_bucket_size": 3000}}
    engine = shardwise.initialize(model, config, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = global_batch(0, 2)
    if rank == 1:
        if how == "exit":
            os._exit(3)
        time.sleep(60)  # alive but never joins the reduction
    engine.backward(engine(x, y))
    engine.step()


def test_a_rank_that_dies_fails_the_job_in_seconds():
    started = time.monotonic()
    with pytest.raises(DistributedTestError, match="rank 1 exited with code 3"):
        run_distributed(_stall_worker, 2, "exit", timeout=60)
    assert time.monotonic() - started < 15


def test_a_collective_that_times_out_names_rank_and_operation():
    started = time.monotonic()
    with pytest.raises(DistributedTestError) as failure:
        run_distributed(_stall_worker, 2, "stall", timeout=60, env={"SHARDWISE_COLLECTIVE_TIMEOUT": "3"})
    message = str(failure.value)
    assert "rank 0: reduce_scatter of gradients of unit" in message, message
    assert "CollectiveError" in message
    assert time.monotonic() - started < 20
