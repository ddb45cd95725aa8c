"""A process that saves a good checkpoint, then starts a second save and freezes at a
chosen point inside it, telling its parent so the parent can SIGKILL it right there.

The freeze points are injected by wrapping functions in this process only (the library
has no test hooks): the second save stops
- "tensor-file": after the first tensor of its rank file is written;
- "before-latest": after the new tag is published, before `latest` is replaced;
- "replacing-tag": saving to the existing tag, after the old directory was moved aside
  and before the new one took its name.
"""

from __future__ import annotations

import hashlib
import os
import time
from multiprocessing.connection import Connection

import torch

from shardwise.runtime.checkpoint import manifest
from shardwise.runtime.checkpoint.safetensors_io import SafetensorsWriter
from tests.runtime.checkpoint.workers import start_engine, train
from tests.runtime.zero.workers import Case

CASE = Case(stage=1)
ROWS = 4


def freeze(parent: Connection, phase: str) -> None:
    parent.send(phase)
    time.sleep(600)


def install_freeze(phase: str, parent: Connection) -> None:
    if phase == "tensor-file":
        write = SafetensorsWriter.write

        def write_then_freeze(self, name, tensor):
            write(self, name, tensor)
            freeze(parent, phase)

        SafetensorsWriter.write = write_then_freeze
    elif phase == "before-latest":
        write_synced = manifest.write_synced

        def freeze_before_latest(path, text):
            if path.name.startswith(".latest"):
                freeze(parent, phase)
            write_synced(path, text)

        manifest.write_synced = freeze_before_latest
    elif phase == "replacing-tag":
        rename = os.rename

        def rename_then_freeze(source, target):
            rename(source, target)
            if str(target).endswith(".replaced"):
                freeze(parent, phase)

        os.rename = rename_then_freeze
    else:
        raise ValueError(phase)


def weights_digest(engine) -> str:
    """sha256 of every parameter's bytes: equal digests mean bit-identical weights."""
    digest = hashlib.sha256()
    for param in engine.module.parameters():
        digest.update(param.detach().numpy().tobytes())
    return digest.hexdigest()


def save_then_freeze(directory: str, phase: str, parent: Connection, asynchronous: bool = False) -> None:
    """Process target (one process, no process group). Sends the digest of the weights it
    saved first, then `phase` when it freezes. `asynchronous`: the second save is, so it
    freezes on the writer thread while the training thread goes on to wait for it."""
    torch.set_num_threads(1)
    engine = start_engine(CASE, 1, ROWS)
    train(engine, CASE.model, 0, 1, ROWS, range(1))
    engine.save_checkpoint(directory, tag="good", client_state={"saved": "first"})
    parent.send(weights_digest(engine))
    train(engine, CASE.model, 0, 1, ROWS, range(1, 2))
    install_freeze(phase, parent)
    second_tag = "good" if phase == "replacing-tag" else "second"
    engine.save_checkpoint(directory, tag=second_tag, client_state={"saved": "second"}, asynchronous=asynchronous)
    if asynchronous:
        train(engine, CASE.model, 0, 1, ROWS, range(2, 3))  # training goes on during the write
        engine.wait_for_checkpoint()
    parent.send("finished without freezing")


def load_after_kill(rank: int, world_size: int, directory: str) -> dict:
    """In a fresh process: load `latest` and describe what came back."""
    engine = start_engine(CASE, 1, ROWS)
    client_state = engine.load_checkpoint(directory)
    return {"client_state": client_state, "global_steps": engine.global_steps, "weights": weights_digest(engine)}
