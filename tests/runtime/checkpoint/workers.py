"""Rank functions for the checkpoint tests: train some steps, optionally load before and
save after, and report losses, full weights and RNG draws.

The global batch has a fixed number of rows whatever the world size (rank r of N takes
rows [r * rows/N, (r + 1) * rows/N)), so a run saved at one world size and resumed at
another sees the same data as one uninterrupted single-process run.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

import numpy as np
import torch

import shardwise
from tests.runtime.zero.workers import Case, build_model, global_batch, make_optimizer, model_loss

PARTITION_EVERYTHING = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}
KEEP_SMALL_WHOLE = {"zero_optimization": {"stage3_param_persistence_threshold": 100}}


@dataclass(frozen=True)
class Run:
    case: Case
    rows: int = 4
    first_step: int = 0
    steps: int = 2
    load_dir: str | None = None
    save_dir: str | None = None
    save_after: int | None = None  # steps into this run; default: at the end
    client_state: dict | None = None


def build_hf_model(kind: str) -> torch.nn.Module:
    """Tiny random-init transformers models; GPT-2 ties its output layer to the embedding."""
    if kind == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(1234)
        return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                                          bos_token_id=0, eos_token_id=0))
    return build_model(kind)


def start_engine(case: Case, world_size: int, rows: int):
    model = build_hf_model(case.model)
    config = dataclasses.replace(case, micro_batch=rows // (world_size * case.accumulation)).config(world_size)
    return shardwise.initialize(model, config, optimizer=make_optimizer(model, case.lr, case.optimizer))


def train(engine, kind: str, rank: int, world_size: int, rows: int, steps: range) -> list[float]:
    """Mean loss over all ranks (and micro-batches) of each step."""
    accumulation = engine.gradient_accumulation_steps
    per_micro = rows // (world_size * accumulation)
    losses = []
    for step in steps:
        x, y = global_batch(step, rows)
        step_loss = 0.0
        for micro in range(accumulation):
            start = (micro * world_size + rank) * per_micro
            rows_here = slice(start, start + per_micro)
            loss = model_loss(engine, kind, x[rows_here].to(engine.device), y[rows_here].to(engine.device))
            engine.backward(loss)
            engine.step()
            step_loss = step_loss + loss.detach().float() / accumulation
        losses.append(step_loss)
    if not losses:
        return []
    losses = torch.stack(losses)
    if world_size > 1:
        torch.distributed.all_reduce(losses)
    return (losses / world_size).tolist()


def full_weights(engine) -> dict[str, torch.Tensor]:
    params = list(engine.module.parameters())
    with shardwise.gathered_parameters(params):
        return {name: p.detach().to("cpu", torch.float32, copy=True) for name, p in engine.module.named_parameters()}


def rng_draws() -> list[float]:
    """One draw from each generator a checkpoint restores (with CUDA, the device's too)."""
    draws = [torch.rand(()).item(), random.random(), float(np.random.rand())]
    if torch.cuda.is_available():
        draws.append(torch.rand((), device="cuda").item())
    return draws


def seed_per_rank(rank: int) -> None:
    """Different streams on every rank, so a restore that mixed ranks up would show."""
    torch.manual_seed(100 + rank)
    random.seed(200 + rank)
    np.random.seed(300 + rank)


def train_run(rank: int, world_size: int, run: Run) -> dict:
    """Optionally load, then train `run.steps` steps from `run.first_step`, saving a
    checkpoint after `run.save_after` of them (if `run.save_dir`) and carrying on."""
    engine = start_engine(run.case, world_size, run.rows)
    seed_per_rank(rank)
    client_state = draws_after_load = draws_after_save = None
    if run.load_dir is not None:
        client_state = engine.load_checkpoint(run.load_dir)
        draws_after_load = rng_draws()
    save_after = run.steps if run.save_after is None else run.save_after
    middle = run.first_step + save_after
    losses = train(engine, run.case.model, rank, world_size, run.rows, range(run.first_step, middle))
    if run.save_dir is not None:
        engine.save_checkpoint(run.save_dir, client_state=run.client_state)
        draws_after_save = rng_draws()
    losses += train(engine, run.case.model, rank, world_size, run.rows, range(middle, run.first_step + run.steps))
    return {
        "losses": losses,
        "params": full_weights(engine),
        "global_steps": engine.global_steps,
        "lr": engine.get_lr(),
        "loss_scaler": engine.loss_scaler.state_dict(),
        "client_state": client_state,
        "draws_after_load": draws_after_load,
        "draws_after_save": draws_after_save,
    }


def logits_after_training(rank: int, world_size: int, kind: str, stage: int, save_dir: str) -> torch.Tensor:
    """Train a transformers model 2 steps, save it, return its logits on a fixed input."""
    case = Case(stage=stage, model=kind, lr=1e-2, extra_config=PARTITION_EVERYTHING)
    engine = start_engine(case, world_size, rows=4)
    train(engine, kind, rank, world_size, 4, range(2))
    engine.save_checkpoint(save_dir)
    engine.eval()
    with torch.no_grad():
        return engine(input_ids=global_batch(99, 2)[0]).logits.float()


class FrozenAndNormed(torch.nn.Module):
    """A frozen input projection and a BatchNorm: state that no optimizer holds."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.project = torch.nn.Linear(8, 16)
        self.project.requires_grad_(False)
        self.norm = torch.nn.BatchNorm1d(16)
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.norm(self.project(x)))).square().mean()


def untrained_state(rank: int, world_size: int, stage: int, directory: str, save: bool) -> dict:
    """Train 2 steps and save (save=True), or load into a differently seeded model; return
    the frozen weights and BatchNorm statistics either way."""
    model = FrozenAndNormed(seed=1 if save else 2)
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine = shardwise.initialize(model, config)
    if save:
        for step in range(2):
            engine.backward(engine(torch.randn(4, 8, generator=torch.Generator().manual_seed(rank * 10 + step))))
            engine.step()
        engine.save_checkpoint(directory)
    else:
        engine.load_checkpoint(directory)
    return {name: tensor.clone() for name, tensor in model.state_dict().items() if "head" not in name}


def peak_rss_growth_of_convert(warm_up: str, directory: str, output: str, dtype: str, parent) -> None:
    """Process target: how far peak RSS rose above the starting RSS while converting.

    Converting the small `warm_up` checkpoint first maps the library code that conversion
    runs (a process forked from the fork server maps it on first use, which would count as
    growth) without leaving large freed blocks behind for the measured run to reuse."""
    from shardwise.runtime.checkpoint import convert_checkpoint

    convert_checkpoint(warm_up, output + "-warm-up", dtype=dtype)

    def kib(field: str) -> int:
        line = next(line for line in open("/proc/self/status") if line.startswith(field + ":"))
        return int(line.split()[1])

    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # reset VmHWM (peak RSS) to the current RSS
    before = kib("VmHWM")
    convert_checkpoint(directory, output, dtype=dtype)
    parent.send((kib("VmHWM") - before) * 1024)
