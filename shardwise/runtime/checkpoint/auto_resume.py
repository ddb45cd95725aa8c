"""Resume from the newest checkpoint of a folder when the engine is built.

What makes a job elastic: torchrun (`shardwise run --max-restarts N`, with `--nnodes
MIN:MAX` across nodes) restarts the workers when one dies, at whatever world size the
surviving nodes make, but the restarted script starts from scratch. With
`CheckpointPolicy.resume_from` set, every engine `shardwise.build_engine` builds first loads the checkpoint
`latest` names in that folder, whatever world size or stage wrote it (checkpoints are
resharded on load, runtime/checkpoint/load.py), so the script needs no resume logic of
its own: it continues from `engine.global_steps`. `latest` only ever names a complete,
verified checkpoint (`manifest.publish`), so a save cut short by the failure is never
picked.

The ranks must see the same folder: they agree on the tag before any of them loads, and
a rank that sees another tag (or none) stops every rank with both named, rather than
some ranks resuming and others waiting in the load's first collective.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

from shardwise.runtime.checkpoint.format import LATEST, CheckpointError
from shardwise.runtime.checkpoint.manifest import read_latest
from shardwise.runtime.engine_protocol import EngineProtocol

log = logging.getLogger("shardwise")


def resume_latest(engine: EngineProtocol, directory: str | Path,
                  load: Callable[[Path, str], dict]) -> dict | None:
    """Load the checkpoint `directory/latest` names into `engine` with `load(folder, tag)`
    (the runtime engine's load_checkpoint, whatever a front end's subclass returns) and
    return its client_state; None (and nothing loaded) when the folder holds no checkpoint."""
    root = Path(directory)
    tag, problem = None, None
    if (root / LATEST).is_file():
        try:
            tag = read_latest(root)
        except CheckpointError as error:  # raised on every rank below, not on this one alone
            problem = str(error)
    seen = engine.world.control_all_gather_object((tag, problem))
    problems = [f"rank {rank}: {text}" for rank, (_, text) in enumerate(seen) if text is not None]
    if problems:
        raise CheckpointError(f"auto-resume from {root}: " + "; ".join(problems))
    tags = [found for found, _ in seen]
    if len(set(tags)) > 1:
        seen = ", ".join(f"rank {rank}: {found or 'no checkpoint'}" for rank, found in enumerate(tags))
        raise CheckpointError(f"auto-resume from {root}: the ranks see different checkpoints ({seen}); every rank "
                              "must reach the same folder (a shared filesystem), or resume by hand with "
                              "engine.load_checkpoint")
    if tag is None:
        log.info("auto-resume: no checkpoint in %s yet, starting from the beginning", root)
        return None
    client_state = load(root, tag)
    log.info("auto-resume: continued from %s/%s at step %d with %d processes",
             root, tag, engine.global_steps, engine.world_size)
    return client_state
