"""How `engine.save_checkpoint` writes, as a policy (the DeepSpeed config maps
`checkpoint.writer.decoupled` to it).

Synchronous (the default), `save_checkpoint` returns once the checkpoint is published.
Asynchronous, it returns once this rank's share is copied to host memory; a background
thread writes, verifies (checksums in the manifest) and publishes it, with the same
atomic renames, while training goes on (runtime/checkpoint/background.py). The price is
a host copy of the rank's share, kept between saves so that only the first one
allocates it.

`resume_from` makes restarts resume by themselves (runtime/checkpoint/auto_resume.py):
`shardwise.build_engine`, once the engine is built, loads the checkpoint `latest` names in that folder, if any, at
whatever world size the restart has (the DeepSpeed config's shardwise block
`auto_resume.checkpoint_dir`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CheckpointPolicy:
    asynchronous: bool = False
    resume_from: str | None = None  # a checkpoint folder; None: no automatic resume
