"""The arguments of `engine.save_checkpoint` / `load_checkpoint`, checked on every rank
at once, so a bad argument is one clear error everywhere instead of a hang.

A checkpoint is collective: every rank writes its shard into the same folder. When one
rank's argument is wrong (None or "" for the folder, a tag that is not a string) and it
raised alone, its peers would wait in the save's first collective until the timeout;
when ranks name different folders (a folder named by the wall-clock second, with ranks
straddling a second), each would write part of a checkpoint nobody can load. So every
rank first checks its own arguments, then all ranks exchange (problem, folder, tag)
in one small collective, and all raise the same error, naming each rank's value.

`checkpoint.tag_validation` (DeepSpeed's Ignore / Warn / Fail): DeepSpeed checks that
ranks agree on the tag, and under Warn or Ignore lets each rank write into its own
tag's folder. shardwise cannot write one checkpoint into several folders, so different
tags are an error in every mode; under Fail the error is also an AssertionError, which is
what DeepSpeed raises there.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from shardwise.frontends.deepspeed.call_arguments import EngineArgumentError, folder_problem
from shardwise.runtime.checkpoint.format import check_tag
from shardwise.runtime.distributed.collectives import Communicator

__all__ = ["CheckpointArgumentError", "TAG_VALIDATION_MODES", "agreed_location", "tag_validation_mode"]

TAG_VALIDATION_MODES = ("IGNORE", "WARN", "FAIL")


class CheckpointArgumentError(EngineArgumentError):
    """A checkpoint call whose arguments are wrong on some rank, or differ between ranks."""


class CheckpointTagMismatch(CheckpointArgumentError, AssertionError):
    """Ranks gave different tags under `checkpoint.tag_validation: Fail` (an AssertionError there, as in DeepSpeed)."""


def tag_validation_mode(raw_config: dict[str, Any]) -> str:
    """`checkpoint.tag_validation` of a DeepSpeed config, upper-cased (default "WARN");
    raises ValueError for another value (the caller turns it into DeepSpeed's config error)."""
    block = raw_config.get("checkpoint") or {}
    mode = str(block.get("tag_validation", "Warn")).upper()
    if mode not in TAG_VALIDATION_MODES:
        raise ValueError(f"checkpoint.tag_validation: {block['tag_validation']!r} is not one of Ignore, Warn, Fail")
    return mode


def _local_problem(call: str, directory: Any, tag: Any) -> str | None:
    problem = folder_problem(call, directory)
    if problem is not None:
        return problem
    if tag is not None:
        try:
            check_tag(str(tag))
        except ValueError as error:
            return f"{call}: {error}"
    return None


def agreed_location(world: Communicator, call: str, directory: Any, tag: Any, *,
                    tag_validation: str = "WARN") -> tuple[Path, str | None]:
    """(folder, tag as a string or None) once every rank of `world` has checked that all
    gave valid and equal ones; otherwise the same CheckpointArgumentError on every rank."""
    problem = _local_problem(call, directory, tag)
    folder = None if problem else os.path.abspath(os.fspath(directory))
    text_tag = None if tag is None else str(tag)
    everyone = world.control_all_gather_object((problem, folder, text_tag))
    problems = [f"rank {rank}: {problem}" for rank, (problem, _, _) in enumerate(everyone) if problem]
    if problems:
        raise CheckpointArgumentError("bad checkpoint arguments:\n  " + "\n  ".join(problems))
    folders = [item[1] for item in everyone]
    if len(set(folders)) > 1:
        named = "\n  ".join(f"rank {rank}: {path}" for rank, path in enumerate(folders))
        raise CheckpointArgumentError(
            f"{call}: the ranks name different checkpoint folders, but a checkpoint is written (and read) by "
            f"every rank in one folder:\n  {named}\ncompute the folder once (on rank 0) and share it, e.g. with "
            "torch.distributed.broadcast_object_list")
    tags = [item[2] for item in everyone]
    if len(set(tags)) > 1:
        named = "\n  ".join(f"rank {rank}: {value!r}" for rank, value in enumerate(tags))
        error = CheckpointTagMismatch if tag_validation == "FAIL" else CheckpointArgumentError
        raise error(f"{call}: the checkpoint tag is not the same on every rank:\n  {named}\nshardwise writes one "
                    "checkpoint per tag with every rank's shard in it; leave rank-specific information out of "
                    "the tag")
    return Path(folders[0]), text_tag
