"""What the DeepSpeed checkpoint tests run on each rank: the fixture's model and steps
(fixtures/tiny.py, fixtures/make_fixtures.py: the same code DeepSpeed ran) under shardwise's
DeepSpeed API, resumed from a DeepSpeed checkpoint."""

from __future__ import annotations

import json
from pathlib import Path


from shardwise.frontends.deepspeed.api.init_engine import initialize
from shardwise.frontends.deepspeed.api.pipe import PipelineModule
from tests.frontends.deepspeed.checkpoints.fixtures import make_fixtures

tiny = make_fixtures.tiny
FIXTURES = Path(make_fixtures.__file__).resolve().parent


def build_engine(case: str, *, stage: int | None = None):
    """The engine the fixture's case trains with, optionally at another ZeRO stage."""
    _, _, pipeline = make_fixtures.CASES[case]
    config = make_fixtures.config_for(case)
    config.pop("checkpoint", None)  # DeepSpeed's switch to read universal folders; shardwise recognises them
    if stage is not None:
        config["zero_optimization"]["stage"] = stage
    if pipeline > 1:
        model = PipelineModule(tiny.pipeline_layers(), num_stages=pipeline, loss_fn=tiny.loss_of,
                               partition_method="uniform")
    else:
        model = tiny.build_model()
    engine, *_ = initialize(model=model, model_parameters=tiny.param_groups(model), config=config)
    return engine


def resume(rank: int, world_size: int, case: str, directory: str, *, stage: int | None = None,
           save_to: str | None = None) -> dict:
    """Load `directory`'s latest checkpoint and train the fixture's next steps; each step's
    loss on every rank, and what was loaded."""
    engine = build_engine(case, stage=stage)
    path, client_state = engine.load_checkpoint(directory)
    start = engine.global_steps
    steps = range(start, start + tiny.STEPS_AFTER_SAVE)
    lr = [group["lr"] for group in engine.optimizer.optimizer.param_groups]
    scaler = engine.loss_scaler.state_dict() if engine.loss_scaler.dynamic else None  # as loaded
    skipped = engine.skipped_steps
    losses = make_fixtures.run_steps(engine, case, steps)
    if save_to is not None:
        engine.save_checkpoint(save_to, tag="resumed")
    return {"losses": losses, "global_steps": start, "client_state": client_state, "path": path, "lr": lr,
            "loss_scaler": scaler, "skipped_steps": skipped}


def fixture_losses(case: str) -> dict:
    """The fixture's recorded losses: `uninterrupted` (6 steps) and `deepspeed_resumed` (the
    3 steps DeepSpeed trained after loading `step3`), each step's loss on every rank."""
    return json.loads((FIXTURES / case / "losses.json").read_text())


def save_for_deepspeed(rank: int, world_size: int, case: str, directory: str, out: str) -> dict:
    """Resume `directory`, train the fixture's next steps and save them in DeepSpeed's layout
    with the compatibility engine's own method; then the losses of 3 steps more."""
    engine = build_engine(case)
    engine.load_checkpoint(directory)
    make_fixtures.run_steps(engine, case, range(engine.global_steps, engine.global_steps + tiny.STEPS_AFTER_SAVE))
    written = engine.save_deepspeed_checkpoint(out, client_state={"note": "back"})
    steps = range(engine.global_steps, engine.global_steps + tiny.STEPS_AFTER_SAVE)
    return {"written": str(written), "losses": make_fixtures.run_steps(engine, case, steps)}
