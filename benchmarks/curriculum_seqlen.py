"""Sequence-length curriculum against none, at the same number of training tokens (C30).

    .venv/bin/python benchmarks/curriculum_seqlen.py [--model 1m] [--steps 200] [--batch 16]
        [--plot benchmarks/results/curriculum_seqlen.png]

The main job's GPT (shardwise.models.gpt, preset `--model`) on the main job's corpus (the
standard library's source as bytes, its last 10% held out), one process, AdamW at the main
job's settings (lr 2e-3, betas 0.9/0.95, weight decay 0.1, eps 1e-8), fp32, trained through
`deepspeed.initialize(training_data=...)` on non-overlapping blocks of the block size + 1
tokens. The baseline trains `--steps` steps on whole blocks. The curriculum run has
`data_efficiency.data_sampling.curriculum_learning` with a `seqlen_truncate` metric
(DeepSpeed's Megatron recipe: one cluster of every sample, each batch cut to the scheduled
length): fixed_linear from 16 to the block size over half the baseline's steps, in steps of
8, and trains until it has consumed the baseline's tokens (more, shorter steps early). Both
runs draw their samples with the same seed; the held-out loss (every 256-token window of the
held-out text, up to 64 of them, at the full block size) is measured at every tenth of the
token budget. Prints a Markdown table and writes the plot and a JSON of the curves.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

import shardwise.frontends.deepspeed.api as deepspeed
from shardwise.models.gpt.model import GPT, GPTConfig
from shardwise.tools.data.corpus import load_tokens, prepare_corpus, split_tokens

REPO = Path(__file__).resolve().parent.parent
START_LENGTH, LENGTH_STEP, CHECKPOINTS = 16, 8, 10


class Blocks(Dataset):
    """Non-overlapping blocks of `length` + 1 tokens (inputs and next-token targets)."""

    def __init__(self, tokens: np.ndarray, length: int):
        self.tokens, self.length = tokens, length

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        start = index * self.length
        return torch.from_numpy(np.array(self.tokens[start: start + self.length + 1], dtype=np.int64))


def held_out_loss(model: torch.nn.Module, val: np.ndarray, length: int, windows: int = 64) -> float:
    blocks = Blocks(val, length)
    batch = torch.stack([blocks[i] for i in range(min(windows, len(blocks)))])
    model.eval()
    with torch.no_grad():
        loss = model(batch[:, :-1], batch[:, 1:]).item()
    model.train()
    return loss


def train(*, curriculum: bool, preset: str, steps: int, batch: int, train_tokens: np.ndarray, val: np.ndarray,
          clusters: str) -> dict:
    torch.manual_seed(0)
    config = GPTConfig.preset(preset)
    model = GPT(config)
    block = config.block_size
    ds_config = {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1,
                 "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "betas": [0.9, 0.95], "eps": 1e-8,
                                                           "weight_decay": 0.1}},
                 "data_efficiency": {"enabled": True, "seed": 1234, "data_sampling": {
                     "enabled": curriculum, "curriculum_learning": {
                         "enabled": curriculum, "data_cluster_path": clusters, "curriculum_metrics": {
                             "seqlen_truncate": {"difficulty_type": "value", "clustering_type": "single_cluster",
                                                 "min_difficulty": START_LENGTH, "max_difficulty": block + 1,
                                                 "schedule_type": "fixed_linear", "schedule_config": {
                                                     "total_curriculum_step": steps // 2,
                                                     "difficulty_step": LENGTH_STEP}}}}}}}
    if not curriculum:
        del ds_config["data_efficiency"]
    engine, _, loader, _ = deepspeed.initialize(model=model, config=ds_config,
                                                training_data=Blocks(train_tokens, block))
    budget = steps * batch * block  # tokens the model reads (inputs), the baseline's total
    marks = [budget * (k + 1) // CHECKPOINTS for k in range(CHECKPOINTS)]
    consumed, curve, held_out, started = 0, [], [], time.perf_counter()
    data = iter(deepspeed.utils.RepeatingLoader(loader))
    while consumed < budget:
        tokens = next(data)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        loss = engine(inputs, targets)
        engine.backward(loss)
        engine.step()
        consumed += inputs.numel()
        curve.append((consumed, inputs.shape[1], loss.item()))
        while marks and consumed >= marks[0]:
            held_out.append((marks.pop(0), held_out_loss(engine.module, val, block)))
    engine.destroy()
    return {"curve": curve, "held_out": held_out, "steps": len(curve), "seconds": time.perf_counter() - started}


def plot(runs: dict[str, dict], path: Path, preset: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    for name, run in runs.items():
        tokens = [c[0] / 1e6 for c in run["curve"]]
        losses = [c[2] for c in run["curve"]]
        window = 10
        smooth = [sum(losses[max(0, i - window + 1): i + 1]) / len(losses[max(0, i - window + 1): i + 1])
                  for i in range(len(losses))]
        left.plot(tokens, smooth, label=f"{name} ({run['steps']} steps)")
        right.plot([h[0] / 1e6 for h in run["held_out"]], [h[1] for h in run["held_out"]], "o-", label=name)
    left.set_title(f"GPT {preset}: training loss (10-step mean) by tokens read")
    right.set_title("held-out loss at the full block size")
    for axis in (left, right):
        axis.set_xlabel("million tokens")
        axis.set_ylabel("cross-entropy")
        axis.grid(alpha=0.3)
        axis.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="1m")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--cache", type=Path, default=REPO / "runs" / "data")
    parser.add_argument("--plot", type=Path, default=REPO / "benchmarks" / "results" / "curriculum_seqlen.png")
    args = parser.parse_args()
    torch.set_num_threads(1)
    train_tokens, val = split_tokens(load_tokens(prepare_corpus(args.cache)))
    runs = {}
    with tempfile.TemporaryDirectory() as clusters:
        for name, curriculum in (("no curriculum", False), ("seqlen curriculum", True)):
            runs[name] = train(curriculum=curriculum, preset=args.model, steps=args.steps, batch=args.batch,
                               train_tokens=train_tokens, val=val, clusters=clusters)
            print(f"{name}: {runs[name]['steps']} steps in {runs[name]['seconds']:.0f} s", flush=True)
    plot(runs, args.plot, args.model)
    args.plot.with_suffix(".json").write_text(json.dumps(runs))
    base, ours = runs["no curriculum"]["held_out"], runs["seqlen curriculum"]["held_out"]
    print(f"\nGPT {args.model}, batch {args.batch}, {args.steps} baseline steps; plot {args.plot.name}")
    print("| thousand tokens read | held-out loss, no curriculum | seqlen curriculum | difference |")
    print("|---|---|---|---|")
    for (tokens, a), (_, b) in zip(base, ours):
        print(f"| {tokens / 1e3:.0f} | {a:.4f} | {b:.4f} | {b - a:+.4f} ({(b / a - 1):+.1%}) |")
    assert all(math.isfinite(h[1]) for h in base + ours)


if __name__ == "__main__":
    main()
