"""`deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine`: DeepSpeed's checkpoint
engine writing each file with `torch.save`.

As DeepSpeed 0.19.8's: without a config it writes torch's legacy (pre-zip) format, with
one the zip format unless `checkpoint.checkpoint_serialization` is false; `create` and
`commit` have nothing to do. One deliberate difference: `load` reads with
`torch.load(weights_only=True)` (tensors, plain containers and the classes a script allows
with `torch.serialization.add_safe_globals`), where DeepSpeed's runs whatever the pickle
names; SHARDWISE_TRUST_PICKLES=1 reads a trusted file as DeepSpeed does (the policy of
frontends/deepspeed/checkpoints/pickles.py).
"""

from __future__ import annotations

import pickle
from typing import Any

import torch

from shardwise.frontends.deepspeed.api.runtime.checkpoint_engine.checkpoint_engine import (
    CheckpointCommitInfo,
    CheckpointEngine,
)
from shardwise.frontends.deepspeed.checkpoints.resume import TRUST_ENVIRONMENT, trust_pickles_from_environment

__all__ = ["ENGINE_NAME", "TorchCheckpointEngine"]

ENGINE_NAME = "TorchCheckpointEngine"
CHECKPOINT_SERIALIZATION = "checkpoint_serialization"  # the config's checkpoint key: the zip format


class TorchCheckpointEngine(CheckpointEngine):
    """Files written by `torch.save` and read by `torch.load` (module docstring).
    `config_params` is DeepSpeed's config object: its `checkpoint_config` dict is read."""

    def __init__(self, config_params: Any = None):
        super().__init__(config_params)
        self.name = ENGINE_NAME
        self.zipfile_serialization = (False if config_params is None
                                      else bool(config_params.checkpoint_config.get(CHECKPOINT_SERIALIZATION, True)))

    def create(self, info: CheckpointCommitInfo) -> None:
        """Nothing to prepare: each `save` writes its file whole."""

    def save(self, state_dict: Any, path: str) -> None:
        torch.save(state_dict, path, _use_new_zipfile_serialization=self.zipfile_serialization)

    def load(self, path: str, map_location: Any = None) -> Any:
        trusted = trust_pickles_from_environment()
        try:
            return torch.load(path, map_location=map_location, weights_only=not trusted)
        except pickle.UnpicklingError as error:
            raise pickle.UnpicklingError(
                f"TorchCheckpointEngine.load({path!r}): the file holds more than tensors and plain containers "
                f"({str(error).strip().splitlines()[0]}), and reading it would run the code it names. Allow the "
                f"classes with torch.serialization.add_safe_globals, or, for a file you trust, set "
                f"{TRUST_ENVIRONMENT}=1 to read it as DeepSpeed does (torch.load(weights_only=False))") from None

    def commit(self, info: CheckpointCommitInfo) -> bool:
        """Every file was written by its `save`: the checkpoint is complete."""
        return True
