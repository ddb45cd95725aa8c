"""Arguments of the engine's collective calls, checked on every rank at once.

A collective call (a save, a load) runs on every rank. When one rank's argument is bad
(None or "" for a folder, a file name that is not a string) and that rank raised alone,
its peers would wait in the call's first collective until the timeout, and a save given
"" would quietly write into the working directory. So each rank checks its own arguments,
all ranks exchange what they found in one small collective, and every rank raises the
same error, naming each rank that was wrong and how to fix it.
"""

from __future__ import annotations

import os
from typing import Any

from shardwise.runtime.distributed.collectives import Communicator

__all__ = ["EngineArgumentError", "folder_problem", "name_problem", "raise_on_every_rank"]


class EngineArgumentError(ValueError):
    """A collective engine call whose arguments are wrong on some rank (raised on every rank)."""


def folder_problem(call: str, directory: Any) -> str | None:
    """What is wrong with `directory` as a folder argument of `call`; None when nothing."""
    if directory is None or (isinstance(directory, (str, os.PathLike)) and not os.fspath(directory)):
        return f"{call}: the folder is {directory!r}; give a non-empty path"
    if not isinstance(directory, (str, os.PathLike)):
        return f"{call}: the folder must be a str or os.PathLike, got {type(directory).__name__} ({directory!r})"
    return None


def name_problem(call: str, argument: str, name: Any) -> str | None:
    """What is wrong with `name` as a plain file name (no folder part) given as `argument`."""
    if not isinstance(name, str) or not name:
        return f"{call}: {argument} must be a non-empty str, got {name!r}"
    if os.sep in name or (os.altsep and os.altsep in name) or name in (".", ".."):
        return f"{call}: {argument} must be a file name without a folder part, got {name!r}; put the folder in save_dir"
    return None


def raise_on_every_rank(world: Communicator, call: str, *problems: str | None,
                        error: type[Exception] = EngineArgumentError) -> None:
    """Raises `error` on every rank of `world` when any rank passed a problem; returns
    on every rank otherwise. Collective: every rank must call it."""
    own = [problem for problem in problems if problem]
    everyone = world.control_all_gather_object(own)
    named = [f"rank {rank}: {problem}" for rank, found in enumerate(everyone) for problem in found]
    if named:
        raise error(f"bad arguments to {call}:\n  " + "\n  ".join(named))
