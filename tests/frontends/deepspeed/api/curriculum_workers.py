"""Rank functions for test_curriculum_loader.py: a DeepSpeed-shaped script with curriculum
learning on (an ordering metric and a `seqlen_truncate` length), training a tiny token
model from the loader `deepspeed.initialize(training_data=...)` builds, recording each
micro-batch's sample indices, sequence length and loss; optionally stopping with a
checkpoint and resuming from it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

import shardwise.frontends.deepspeed.api as deepspeed
from shardwise.runtime.data.indexed_dataset import write_rows

ROWS, LENGTH, VOCAB, MICRO, ACCUMULATION, SEED = 24, 16, 11, 2, 2, 3
LR, EPS = 0.02, 1e-4


class Tokens(Dataset):
    def __init__(self):
        self.tokens = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, index: int):
        return {"tokens": self.tokens[index], "index": index}


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.out = nn.Linear(8, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.out(torch.tanh(self.embed(tokens[:, :-1])))
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def write_index(folder: str) -> tuple[str, str]:
    """The `mod` metric's index: sample i has value i % 5."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    values = np.arange(ROWS) % 5
    prefix = f"{folder}/mod"
    write_rows(f"{prefix}_index_to_sample", [np.flatnonzero(values == v) for v in range(5)], np.uint8)
    write_rows(f"{prefix}_index_to_metric", [np.array([v]) for v in range(5)], np.uint8)
    return f"{prefix}_index_to_sample", f"{prefix}_index_to_metric"


def config(folder: str, world_size: int, clusters: str | None = None) -> dict:
    """Index files in `folder`; clusters in `clusters` (default folder/clusters)."""
    to_sample, to_metric = f"{folder}/mod_index_to_sample", f"{folder}/mod_index_to_metric"
    metrics = {
        "mod": {"index_to_sample_path": to_sample, "index_to_metric_path": to_metric, "difficulty_type": "value",
                "clustering_type": "schedule_based", "min_difficulty": 1, "max_difficulty": 4,
                "schedule_type": "fixed_discrete", "schedule_config": {"difficulty": [1, 2, 4], "max_step": [2, 4]}},
        "seqlen_truncate": {"difficulty_type": "value", "clustering_type": "single_cluster", "min_difficulty": 8,
                            "max_difficulty": LENGTH, "schedule_type": "fixed_linear",
                            "schedule_config": {"total_curriculum_step": 4, "difficulty_step": 4}},
    }
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUMULATION,
            "train_batch_size": MICRO * ACCUMULATION * world_size,
            "optimizer": {"type": "Adam", "params": {"lr": LR, "eps": EPS}},
            "zero_optimization": {"stage": 2},
            "data_efficiency": {"enabled": True, "seed": SEED, "data_sampling": {
                "enabled": True, "num_epochs": 10, "curriculum_learning": {
                    "enabled": True, "data_cluster_path": clusters or f"{folder}/clusters",
                    "curriculum_metrics": metrics}}}}


def train(rank: int, world_size: int, folder: str, *, steps: int, stop_at: int | None = None,
          resume: bool = False) -> list[dict]:
    torch.manual_seed(0)
    engine, _, loader, _ = deepspeed.initialize(model=TinyLM(), config=config(folder, world_size),
                                                training_data=Tokens())
    seen: list[dict] = []
    def post_process(batch, state):
        seen.append(dict(state["current_difficulties"]))
        return batch

    engine.set_data_post_process_func(post_process)
    if resume:
        engine.load_checkpoint(f"{folder}/checkpoint")
    records: list[dict] = []
    for batch in loader:
        step = engine.global_steps
        loss = engine(batch["tokens"])
        engine.backward(loss)
        engine.step()
        records.append({"step": step, "loss": loss.item(), "indices": batch["index"].tolist(),
                        "length": batch["tokens"].shape[1], "difficulties": seen[-1]})
        if engine.global_steps > step and engine.global_steps in (stop_at, steps):
            if engine.global_steps == stop_at:
                engine.save_checkpoint(f"{folder}/checkpoint")
            break
    engine.destroy()
    return records
