"""Rank functions for the divergence tests: ranks that run, or are given, different work
after a start-up where they agreed (a rank-dependent schedule, an extra micro-batch, a
skipped step(), weights edited on one rank)."""

from __future__ import annotations

import torch

import shardwise
from tests.runtime.zero.workers import Case, build_model, global_batch, make_optimizer, model_loss


def _engine(case: Case, world_size: int, **kwargs):
    model = build_model(case.model)
    return shardwise.initialize(model, case.config(world_size), optimizer=make_optimizer(model, case.lr),
                                **kwargs), model


def _micro_batch(case: Case, rank: int, world_size: int, index: int):
    x, y = global_batch(index, world_size * case.micro_batch)
    start = rank * case.micro_batch
    return x[start:start + case.micro_batch], y[start:start + case.micro_batch]


def rank_dependent_schedule(rank: int, world_size: int, stage: int) -> int:
    """Rank 1's scheduler doubles the rate from its first step on: the start-up agreement
    sees equal rates, the step check must see them differ."""
    case = Case(stage=stage, clipping=0.0)
    factor = 1.0 + rank
    engine, model = _engine(case, world_size, lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: 1.0 if step == 0 else factor))
    for step in range(3):
        engine.backward(model_loss(engine, case.model, *_micro_batch(case, rank, world_size, step)))
        engine.step()
    return engine.global_steps


def skip_a_step(rank: int, world_size: int, stage: int) -> int:
    """Rank 1 forgets engine.step() after its second backward."""
    case = Case(stage=stage, model="gpt-untied" if stage == 3 else "gpt")
    engine, _ = _engine(case, world_size)
    for index in range(4):
        engine.backward(model_loss(engine, case.model, *_micro_batch(case, rank, world_size, index)))
        if not (rank == 1 and index == 1):
            engine.step()
    return engine.global_steps


def several_backwards_per_step(rank: int, world_size: int, stage: int) -> list[float]:
    """Two losses, two backwards, one step, on every rank (DeepSpeedExamples' GAN): the
    check that pairs a new backward with a peer's step passes."""
    case = Case(stage=stage, model="gpt-untied" if stage == 3 else "gpt")
    engine, model = _engine(case, world_size)
    for index in range(2):
        engine.backward(model_loss(engine, case.model, *_micro_batch(case, rank, world_size, 2 * index)))
        engine.backward(model_loss(engine, case.model, *_micro_batch(case, rank, world_size, 2 * index + 1)))
        engine.step()
    with shardwise.gathered_parameters(list(model.parameters())):
        return [float(p.detach().double().sum()) for p in model.parameters()]


def edit_weights_on_one_rank(rank: int, world_size: int, stage: int, interval: int, edit: bool,
                             directory: str | None) -> int:
    """Rank 1 adds 1e-3 to one weight after initialize (when `edit`); replicas compare their
    weights every `interval` steps, and before the checkpoint saved into `directory`."""
    case = Case(stage=stage, extra_config={"replica_check": {"interval": interval}})
    engine, model = _engine(case, world_size)
    if edit and rank == 1:
        with torch.no_grad():
            dict(model.named_parameters())["blocks.1.mlp.fc.weight"][0, 0] += 1e-3
    for step in range(3):
        engine.backward(model_loss(engine, case.model, *_micro_batch(case, rank, world_size, step)))
        engine.step()
    if directory is not None:
        engine.save_checkpoint(directory)
    return engine.global_steps


def gather_on_one_rank(rank: int, world_size: int) -> int:
    """Stage 3: after a step, rank 1 reads its weights with gathered_parameters while rank 0
    trains on."""
    case = Case(stage=3, model="gpt-untied")
    engine, model = _engine(case, world_size)
    for index in range(2):
        if rank == 1 and index == 1:
            with shardwise.gathered_parameters(list(model.parameters())):
                pass
        engine.backward(model_loss(engine, case.model, *_micro_batch(case, rank, world_size, index)))
        engine.step()
    return engine.global_steps


def evaluate_on_one_rank(rank: int, world_size: int) -> int:
    """Stage 3: after a step, rank 1 runs an extra forward without gradients (an evaluation)."""
    case = Case(stage=3, model="gpt-untied")
    engine, _ = _engine(case, world_size)
    for index in range(2):
        if rank == 1 and index == 1:
            with torch.no_grad():
                model_loss(engine, case.model, *_micro_batch(case, rank, world_size, 9))
        engine.backward(model_loss(engine, case.model, *_micro_batch(case, rank, world_size, index)))
        engine.step()
    return engine.global_steps
