"""Rank functions for test_data_position.py: a DeepSpeed-shaped script that trains from the
loader `deepspeed.initialize(training_data=...)` builds, stops at an optimizer step with a
checkpoint, and resumes from it, recording each micro-batch's loss and sample indices."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset

import shardwise.frontends.deepspeed.api as deepspeed

ROWS, FEATURES, GLOBAL_BATCH, MICRO = 40, 4, 8, 2  # 5 optimizer steps per epoch


class IndexedRows(Dataset):
    """Regression rows that also return their index, so the test can see which were read."""

    def __init__(self):
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(ROWS, FEATURES, generator=generator)
        self.y = self.x.sum(dim=1).sin()

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, index: int):
        return self.x[index], self.y[index], index


def train(rank: int, world_size: int, directory: str, *, steps: int, stop_at: int | None = None,
          resume: bool = False, set_epoch: bool = True, auto_resume: bool = False) -> list[dict]:
    """Train until optimizer step `steps` (or `stop_at`, then save); `resume`: from the
    checkpoint in `directory`. `set_epoch`: the script calls loader.sampler.set_epoch each
    epoch (else every epoch has the same order, DeepSpeed's default). One record per
    micro-batch: optimizer step it belongs to, this rank's loss, its sample indices."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, 1))
    config = {"train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": MICRO,
              "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "eps": 1e-4}},
              "zero_optimization": {"stage": 2}}
    if auto_resume:
        config["auto_resume"] = {"checkpoint_dir": directory}
    engine, _, loader, _ = deepspeed.initialize(model=model, config=config, training_data=IndexedRows())
    epoch = 0
    if auto_resume and engine.resumed_client_state is not None:
        epoch = engine.resumed_client_state["epoch"]
    elif resume:
        _, client_state = engine.load_checkpoint(directory)
        epoch = client_state["epoch"]
    records: list[dict] = []
    while engine.global_steps < steps:
        if set_epoch:
            loader.sampler.set_epoch(epoch)
        for x, y, index in loader:
            step = engine.global_steps
            loss = nn.functional.mse_loss(engine(x).squeeze(-1), y)
            engine.backward(loss)
            engine.step()
            records.append({"step": step, "loss": loss.item(), "indices": index.tolist()})
            if engine.global_steps > step and engine.global_steps in (stop_at, steps):
                if engine.global_steps == stop_at:
                    engine.save_checkpoint(directory, client_state={"epoch": epoch})
                engine.destroy()
                return records
        epoch += 1
    engine.destroy()
    return records
