"""`deepspeed.runtime.checkpoint_engine.checkpoint_engine`: what a DeepSpeed checkpoint
engine is. A save is `create(info)`, then `save(state_dict, path)` for each file (after
`makedirs`), then `commit(info)` once every file is written; an engine that writes in the
background (`is_decoupled()`) commits later. Subclasses implement the four abstract
methods; the rest have DeepSpeed 0.19.8's defaults."""

from __future__ import annotations

import abc
import os
from dataclasses import dataclass
from typing import Any

__all__ = ["CheckpointCommitInfo", "CheckpointEngine"]


@dataclass
class CheckpointCommitInfo:
    """The checkpoint being saved: its tag, its folder, and whether `latest` is to name it."""

    tag: str
    save_dir: str
    save_latest: bool


class CheckpointEngine(abc.ABC):
    """DeepSpeed's checkpoint engine interface (module docstring)."""

    def __init__(self, config_params: Any = None):
        self.name: str | None = None

    @abc.abstractmethod
    def create(self, info: CheckpointCommitInfo) -> None:
        """Begin saving the checkpoint `info` names."""

    @abc.abstractmethod
    def save(self, state_dict: Any, path: str) -> None:
        """Write `state_dict` to the file `path`."""

    @abc.abstractmethod
    def load(self, path: str, map_location: Any = None) -> Any:
        """The object the file `path` holds, its tensors moved by `map_location` (torch.load's)."""

    @abc.abstractmethod
    def commit(self, info: CheckpointCommitInfo) -> bool:
        """Every file of the checkpoint `info` names is written: publish it."""

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        os.makedirs(path, exist_ok=exist_ok)

    def is_data_parallel_writer(self, dp_rank: int) -> bool:
        """Whether the data-parallel rank `dp_rank` writes the files every such rank holds alike."""
        return dp_rank == 0

    def is_decoupled(self) -> bool:
        """Whether saves finish in the background (then the caller commits later)."""
        return False

    def set_commit_info(self, info: CheckpointCommitInfo) -> None:
        """Remember the checkpoint a background save is to commit; nothing to remember here."""

    def get_commit_info(self) -> CheckpointCommitInfo | None:
        return None

    def cleanup(self) -> None:
        """Release what a background writer holds; nothing here."""

    def preserves_storage_sharing(self) -> bool:
        """Whether tensors sharing a storage are written once (torch.save does, so callers
        clone views they do not want saved whole)."""
        return True
