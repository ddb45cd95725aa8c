"""Curriculum learning through `deepspeed.initialize(training_data=...)` (C30): the loader
draws DeepSpeed's curriculum batches, each rank its slice, truncated to the scheduled
sequence length; the engine's losses equal a single-process reference trained on the same
truncated batches; a run resumed from a checkpoint draws and trains exactly as the
uninterrupted one."""

from __future__ import annotations

import pytest
import torch

from shardwise.frontends.deepspeed.config import load_config
from shardwise.frontends.deepspeed.config.policies import policies_from_config
from shardwise.runtime.data.difficulty_sampler import DifficultySampler
from shardwise.tools.testing import run_distributed
from tests.frontends.deepspeed.api.curriculum_workers import (
    ACCUMULATION, EPS, LR, MICRO, TinyLM, Tokens, config, train, write_index)
from tests.frontends.deepspeed.api.test_data_position import relative_error
from tests.runtime.data.test_difficulty_sampler import Alone

STEPS, STOP, WORLD = 6, 3, 2


def reference_losses(runs: list[list[dict]]) -> list[list[float]]:
    """One process, plain torch: every rank's micro-batch (the recorded indices, cut to the
    recorded length) at each accumulation step, gradients averaged over ranks and steps."""
    torch.manual_seed(0)
    model, data = TinyLM(), Tokens()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR, eps=EPS)
    losses: list[list[float]] = [[] for _ in runs]
    for micro in range(len(runs[0])):
        for rank, records in enumerate(runs):
            record = records[micro]
            tokens = data.tokens[record["indices"], : record["length"]]
            loss = model(tokens)
            (loss / (len(runs) * ACCUMULATION)).backward()
            losses[rank].append(loss.item())
        if (micro + 1) % ACCUMULATION == 0:
            optimizer.step()
            optimizer.zero_grad()
    return losses


def test_curriculum_batches_truncated_and_trained_as_the_reference(tmp_path):
    write_index(str(tmp_path))
    runs = run_distributed(train, WORLD, str(tmp_path), steps=STEPS)
    # the indices: a single-process sampler's global batches, each rank its slice
    single = load_config(config(str(tmp_path), WORLD, str(tmp_path / "single")), world_size=WORLD)
    policy = policies_from_config(single).data_sampling
    sampler = iter(DifficultySampler(policy, samples=len(Tokens()), micro_batch_size=MICRO * WORLD,
                                     gradient_accumulation_steps=ACCUMULATION, replicas=Alone()))
    for micro in range(len(runs[0])):
        assert runs[0][micro]["indices"] + runs[1][micro]["indices"] == next(sampler)
    for record in runs[0]:  # seqlen_truncate: 8 + 8 * step / 4 rounded down to 4s; mod: samples of value <= it
        assert record["length"] == min(16, (8 + 2 * (record["step"] + 1)) // 4 * 4)
        assert record["length"] == record["difficulties"]["seqlen_truncate"]
        assert max(index % 5 for index in record["indices"]) <= record["difficulties"]["mod"]
    for ours, theirs in zip(runs, reference_losses(runs)):
        assert relative_error([r["loss"] for r in ours], theirs) < 1e-5


@pytest.mark.slow  # the default run's exact resume: tests/runtime/data/test_difficulty_sampler.py
def test_a_resumed_curriculum_run_equals_the_uninterrupted_one(tmp_path):
    for folder in ("whole", "run"):
        write_index(str(tmp_path / folder))
    whole = run_distributed(train, WORLD, str(tmp_path / "whole"), steps=STEPS)
    first = run_distributed(train, WORLD, str(tmp_path / "run"), steps=STEPS, stop_at=STOP)
    rest = run_distributed(train, WORLD, str(tmp_path / "run"), steps=STEPS, resume=True)
    for rank in range(WORLD):
        resumed = first[rank] + rest[rank]
        assert [(r["step"], r["indices"], r["length"]) for r in resumed] == \
            [(r["step"], r["indices"], r["length"]) for r in whole[rank]]
        assert relative_error([r["loss"] for r in resumed], [r["loss"] for r in whole[rank]]) < 1e-6
