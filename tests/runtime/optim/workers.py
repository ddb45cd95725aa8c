"""Shared by the optimizer tests: the parallel-vs-one-process check over ZeRO stages and
world sizes, and runs of the optimizers shardwise builds from a DeepSpeed config block
(the path that checkpoints through the optimizer's own codec) with their single-process
reference.

The config runs' global batch has a fixed number of rows whatever the world size
(tests/runtime/checkpoint/workers.py's `train`), so a run saved at one world size and resumed at
another sees the same data as one uninterrupted single-process run.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import shardwise
from shardwise.runtime.optim.registry import optimizer_spec
from shardwise.tools.testing import run_distributed
from tests.runtime.checkpoint.workers import full_weights, train
from tests.runtime.zero.workers import (
    Case,
    build_model,
    global_batch,
    model_loss,
    relative_error,
    train_parallel,
    train_reference,
)

STEPS_BEFORE_SAVE = 1
STEPS_AFTER_LOAD = 2


@dataclass(frozen=True)
class ConfigRun:
    optimizer: dict  # the config's "optimizer" block
    stage: int = 0
    rows: int = 8
    first_step: int = 0
    steps: int = 1
    load_dir: str | None = None
    save_dir: str | None = None
    model: str = "gpt"

    def config(self, world_size: int) -> dict:
        zero = {"stage": self.stage, "reduce_bucket_size": 3000, "allgather_bucket_size": 3000}
        if self.stage == 3:
            zero["stage3_param_persistence_threshold"] = 0
        return {"train_micro_batch_size_per_gpu": self.rows // world_size, "zero_optimization": zero,
                "optimizer": self.optimizer}


def train_from_config(rank: int, world_size: int, run: ConfigRun) -> dict:
    """Optionally load, train `run.steps` steps, optionally save; report losses, weights,
    memory and the parameter pieces this rank's optimizer trains."""
    engine = shardwise.initialize(build_model(run.model), run.config(world_size))
    if run.load_dir is not None:
        engine.load_checkpoint(run.load_dir)
    losses = train(engine, run.model, rank, world_size, run.rows, range(run.first_step, run.first_step + run.steps))
    if run.save_dir is not None:
        engine.save_checkpoint(run.save_dir)
    optimizer = engine.optimizer.optimizer
    shards = [optimizer.shard_of(segment.master) for segment in engine.optimizer.segments]
    return {
        "losses": losses,
        "params": full_weights(engine),
        "optimizer_states": engine.memory_breakdown()["optimizer_states"],
        "pieces": [(shard.name, shard.shape, shard.start, shard.stop) for shard in shards],
        "class": type(optimizer).__name__,
    }


def train_reference_from_config(optimizer: dict, rows: int, steps: int, model_kind: str = "gpt") -> dict:
    """One process, plain PyTorch, the registry's optimizer over all parameters in one
    group (as the engine builds it from a config)."""
    model = build_model(model_kind)
    opt = optimizer_spec(optimizer["type"]).build([{"params": list(model.parameters())}], optimizer.get("params", {}))
    losses = []
    for step in range(steps):
        x, y = global_batch(step, rows)
        loss = model_loss(model, model_kind, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {name: p.detach().clone() for name, p in model.named_parameters()}}


def assert_resume_matches(saved: dict, resumed: dict, expected: dict, tolerance: float) -> None:
    for step, got in enumerate(saved["losses"] + resumed["losses"]):
        want = expected["losses"][step]
        assert abs(got - want) / want < 1e-5, f"step {step}: loss {got} vs {want}"
    for name, want in expected["params"].items():
        error = relative_error(resumed["params"][name], want)
        assert error < tolerance, f"{name}: relative error {error:.2e} >= {tolerance}"


def save_then_resume(tmp_path, optimizer: dict) -> tuple[dict, dict, dict]:
    """Train at 2 ranks / stage 2 and save, resume at 1 rank / stage 0; with the
    uninterrupted single-process reference."""
    saved = run_distributed(train_from_config, 2, ConfigRun(optimizer, stage=2, steps=STEPS_BEFORE_SAVE,
                                                            save_dir=str(tmp_path)))
    resumed = run_distributed(train_from_config, 1, ConfigRun(optimizer, stage=0, first_step=STEPS_BEFORE_SAVE,
                                                              steps=STEPS_AFTER_LOAD, load_dir=str(tmp_path)))[0]
    expected = train_reference_from_config(optimizer, rows=8, steps=STEPS_BEFORE_SAVE + STEPS_AFTER_LOAD)
    return saved, resumed, expected


# (stage, world size): world 4 only where pieces cut parameters (stages 1-3)
STAGES_AND_WORLDS = [(0, 1), (0, 2), (1, 4), (2, 2), (2, 4), (3, 2), (3, 4)]


@lru_cache(maxsize=None)
def reference(optimizer: str, world_size: int, model: str) -> dict:
    return train_reference(Case(optimizer=optimizer, model=model), world_size)


def check_against_one_process(optimizer: str, stage: int, world_size: int, tolerance: float) -> None:
    """tests/runtime/zero/workers.py's parallel run (OPTIMIZERS[optimizer] over two param groups)
    against the same optimizer on whole parameters in one process: losses within 1e-5,
    final weights within `tolerance`."""
    model = "gpt-untied" if stage == 3 else "gpt"
    extra = {"zero_optimization": {"stage3_param_persistence_threshold": 0}} if stage == 3 else {}
    case = Case(stage=stage, optimizer=optimizer, model=model, extra_config=extra)
    want = reference(optimizer, world_size, model)
    for result in run_distributed(train_parallel, world_size, case):
        for step, (got, expected) in enumerate(zip(result["losses"], want["losses"])):
            assert abs(got - expected) / expected < 1e-5, f"step {step}: loss {got} vs {expected}"
        for name, expected in want["params"].items():
            error = relative_error(result["params"][name], expected)
            assert error < tolerance, f"{name}: relative error {error:.2e} >= {tolerance}"


def parameter_shapes(model_kind: str = "gpt") -> dict[str, tuple[int, ...]]:
    """Trained parameters by name (tied weights once)."""
    return {name: tuple(p.shape) for name, p in build_model(model_kind).named_parameters()}


def step_once_in_process(optimizer: dict, stage: int = 0) -> shardwise.Engine:
    """A one-process engine from a config with this optimizer block, after one step."""
    engine = shardwise.initialize(build_model("gpt"), ConfigRun(optimizer, stage=stage, rows=2).config(1))
    x, y = global_batch(0, 2)
    engine.backward(engine(x, y))
    engine.step()
    return engine
