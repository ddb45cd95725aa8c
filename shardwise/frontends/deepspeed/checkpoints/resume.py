"""Open a DeepSpeed checkpoint for an engine: what `engine.load_checkpoint(dir)` does when
`dir` holds DeepSpeed's files (the ConfiguredEngine and DeepSpeed's API engine call it).

The engine supplies what DeepSpeed's files leave to the loading engine: which parameters
each optimizer group trains (checkpoints without ZeRO record the groups by position only,
as DeepSpeed's own loader reads them), the optimizer it trains with, the hyper-parameters
its groups have, and its loss-scale hysteresis.
"""

from __future__ import annotations

import os
from pathlib import Path

from shardwise.frontends.deepspeed.checkpoints.reader import read_deepspeed_checkpoint
from shardwise.frontends.deepspeed.checkpoints.to_shardwise import opened_checkpoint, optimizer_class_of
from shardwise.runtime.checkpoint.format import CheckpointError
from shardwise.runtime.checkpoint.load import OpenedCheckpoint
from shardwise.runtime.checkpoint.pieces import describe_model
from shardwise.runtime.engine_protocol import EngineProtocol

TRUST_ENVIRONMENT = "SHARDWISE_TRUST_PICKLES"


def trust_pickles_from_environment() -> bool:
    """`SHARDWISE_TRUST_PICKLES=1`: the opt-in for scripts that cannot pass `trust_pickles`
    (unmodified DeepSpeed scripts under `shardwise run --as-deepspeed`)."""
    return os.environ.get(TRUST_ENVIRONMENT, "").strip().lower() in ("1", "true", "yes")


def open_deepspeed_checkpoint(engine: EngineProtocol, directory: Path, *, optimizer_states: bool = True,
                              trusted: bool = False) -> OpenedCheckpoint:
    """The DeepSpeed checkpoint in `directory` (one tag's folder), ready for the engine's loader."""
    description = describe_model(engine)
    groups = {entry["name"]: entry["group"] for entry in description["parameters"] if "group" in entry}
    contents = read_deepspeed_checkpoint(directory, trusted=trusted or trust_pickles_from_environment(),
                                         groups=groups)
    if not engine.trains:
        return opened_checkpoint(contents, optimizer_class="", optimizer_states=False)
    optimizer = engine.optimizer.optimizer
    engine_class = type(optimizer).__name__
    saved_class = optimizer_class_of(contents)
    restoring = optimizer_states and any(step is not None for step in contents.group_steps)
    if restoring and saved_class is not None and saved_class != engine_class:
        raise CheckpointError(f"checkpoint {directory} was trained with {saved_class} (its DeepSpeed config's "
                              f"optimizer), this engine uses {engine_class}: train with the same optimizer, or "
                              "load the weights only (load_optimizer_states=False)")
    group_keys = [set(group) - {"params"} for group in optimizer.param_groups]
    return opened_checkpoint(contents, optimizer_class=engine_class, group_keys=group_keys,
                             hysteresis=engine.loss_scaler.hysteresis, optimizer_states=optimizer_states)
