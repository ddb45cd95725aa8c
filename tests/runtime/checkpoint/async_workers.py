"""Rank functions for the asynchronous-save tests (test_async_save.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from shardwise.runtime.checkpoint import CheckpointError
from shardwise.runtime.checkpoint.safetensors_io import SafetensorsWriter
from tests.runtime.checkpoint.workers import start_engine, train
from tests.runtime.zero.workers import Case

ROWS = 4


def sync_then_async(rank: int, world_size: int, case: Case, directory: str) -> dict:
    """Train, save the same state synchronously (into sync/) and asynchronously (into
    async/), then train on while the asynchronous write runs: the files must hold the
    state at the save, not what training made of it since."""
    engine = start_engine(case, world_size, ROWS)
    train(engine, case.model, rank, world_size, ROWS, range(2))
    state = {"step": 2, "note": ["a", 1]}
    engine.save_checkpoint(Path(directory) / "sync", tag="same", client_state=state)
    engine.save_checkpoint(Path(directory) / "async", tag="same", client_state=state, asynchronous=True)
    state["note"].append("changed after the save")  # the checkpoint keeps what was given
    masters = [segment.master for segment in engine.optimizer.segments]  # stage 3: parameters are placeholders
    before = [master.detach().clone() for master in masters]
    train(engine, case.model, rank, world_size, ROWS, range(2, 4))
    changed = any(not torch.equal(old, master) for old, master in zip(before, masters))
    engine.wait_for_checkpoint()
    engine.destroy()
    return {"trained_during_write": changed}


def failing_async_write(rank: int, world_size: int, case: Case, directory: str, failing_rank: int) -> dict:
    """A good synchronous save, then an asynchronous one whose tensor file cannot be
    written on `failing_rank`: every rank must raise, at its next call."""
    engine = start_engine(case, world_size, ROWS)
    train(engine, case.model, rank, world_size, ROWS, range(1))
    engine.save_checkpoint(directory, tag="good")
    if rank == failing_rank:
        def refuse(self, name, tensor):
            raise OSError(28, "No space left on device (injected)")

        SafetensorsWriter.write = refuse
    engine.save_checkpoint(directory, tag="second", asynchronous=True)
    train(engine, case.model, rank, world_size, ROWS, range(1, 2))  # training goes on meanwhile
    try:
        engine.wait_for_checkpoint()
    except CheckpointError as error:
        message = str(error)
    else:
        message = None
    engine.wait_for_checkpoint()  # raised once: the next call is clean
    latest = (Path(directory) / "latest").read_text().strip()
    engine.destroy()
    return {"error": message, "latest": latest}


def async_then_resume(rank: int, world_size: int, case: Case, directory: str) -> dict:
    """The next save joins the previous write; a load of the asynchronous checkpoint
    resumes it exactly (losses of the steps after it)."""
    engine = start_engine(case, world_size, ROWS)
    train(engine, case.model, rank, world_size, ROWS, range(1))
    engine.save_checkpoint(directory, asynchronous=True)  # global_step1
    train(engine, case.model, rank, world_size, ROWS, range(1, 2))
    engine.save_checkpoint(directory, asynchronous=True)  # global_step2: waits for global_step1 first
    after = train(engine, case.model, rank, world_size, ROWS, range(2, 4))
    engine.destroy()  # joins global_step2
    fresh = start_engine(dataclasses.replace(case), world_size, ROWS)
    fresh.load_checkpoint(directory)
    steps = fresh.global_steps
    resumed = train(fresh, case.model, rank, world_size, ROWS, range(2, 4))
    return {"after": after, "resumed": resumed, "steps": steps}
