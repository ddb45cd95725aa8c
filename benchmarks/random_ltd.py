"""Random-LTD's tokens and step time on the main job's GPT (issue 28, C30).

    .venv/bin/python benchmarks/random_ltd.py [--preset 10m] [--steps 12] [--seq-len 256] [--micro-batch 4]

One process, one thread, ZeRO stage 0, fp32, AdamW; the same GPT, data (windows of the
standard library's sources) and seed in each variant; the variants' engines take their
steps in turn, so a busy machine slows each alike. The dropping layers are all but the
first and the last (the paper's and DeepSpeed's examples' choice); each variant keeps a
fixed share of the tokens in them (min_value = kept, max_value = the sequence length, and
require_steps far beyond the run, so the count does not move; DeepSpeed counts max_value
tokens for the other layers, so max_value must be the sequence length):

- none       every layer on every token;
- keep-75%, keep-50%, keep-25%: the middle layers on that share of each sequence.

It prints, per variant, the layer-tokens a step processes (the engine's
consumed_layer_tokens per step beside `random_ltd_layer_tokens`), their share of the
full count, and the median step time and its ratio to `none`. The time saved is below
the token share: the embedding, the first and last layers, the output layer and loss,
and the optimizer step do not shrink, and the gather/scatter adds a little.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload import ByteBatches, build_gpt  # noqa: E402

import shardwise  # noqa: E402
from shardwise.formulas.data_efficiency import random_ltd_layer_tokens  # noqa: E402

SEED = 1234
SHARES = {"none": None, "keep-75%": 0.75, "keep-50%": 0.5, "keep-25%": 0.25}


def config(share: float | None, layers: int, args: argparse.Namespace) -> dict:
    config = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "eps": 1e-8, "weight_decay": 0.01}},
              "zero_optimization": {"stage": 0}}
    if share is not None:
        kept = int(args.seq_len * share)
        config["data_efficiency"] = {"seed": SEED, "data_routing": {"random_ltd": {
            "enabled": True, "total_layer_num": layers, "random_ltd_layer_num": layers - 2,
            "random_ltd_layer_id": list(range(1, layers - 1)), "model_mask_name": None, "model_type": "decoder",
            "hidden_state_order": "batch_seq_dim",
            "random_ltd_schedule": {"min_value": kept, "max_value": args.seq_len, "schedule_type": "fixed_linear",
                                    "schedule_config": {"require_steps": 10**9, "seq_per_step": 1}}}}}
    return config


class Variant:
    """One engine of the comparison; `step` runs and times one optimizer step."""

    def __init__(self, name: str, args: argparse.Namespace):
        model = build_gpt(args.preset, SEED)
        self.layers = len(model.blocks)
        self.engine = shardwise.initialize(model, config(SHARES[name], self.layers, args))
        share = SHARES[name]
        self.formula = random_ltd_layer_tokens(int(args.seq_len * share) if share else args.seq_len,
                                               max_value=args.seq_len, layers=self.layers,
                                               dropping_layers=self.layers - 2 if share else 0,
                                               global_batch=args.micro_batch)
        self.seconds: list[float] = []
        self.layer_tokens: list[int] = []

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        state = self.engine.random_ltd
        before = state.state_dict()["consumed_layer_tokens"] if state is not None else 0
        started = time.perf_counter()
        loss = self.engine(inputs, targets)
        self.engine.backward(loss)
        self.engine.step()
        self.seconds.append(time.perf_counter() - started)
        after = state.state_dict()["consumed_layer_tokens"] if state is not None else self.formula
        self.layer_tokens.append(after - before)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="10m")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of the timings")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(1)
    variants = {name: Variant(name, args) for name in SHARES}
    batches = ByteBatches(SEED, 1, args.micro_batch, args.seq_len)
    for step in range(args.steps):  # the variants in turn, step by step: each sees the same load
        inputs, targets = batches.batch(step, 0)
        for variant in variants.values():
            variant.step(inputs, targets)
    medians = {name: statistics.median(variant.seconds[args.warmup:]) for name, variant in variants.items()}
    full = variants["none"].formula
    print(f"GPT {args.preset} ({variants['none'].layers} layers), micro-batch {args.micro_batch} x {args.seq_len} "
          f"tokens, {args.steps} steps (timings: last {args.steps - args.warmup}), load average "
          f"{os.getloadavg()[0]:.1f}")
    print("| variant | layer-tokens per step (counted / formula) | share | median step s | x none |")
    print("|---|---|---|---|---|")
    for name, variant in variants.items():
        counted = statistics.mean(variant.layer_tokens)
        print(f"| {name} | {counted:,.0f} / {variant.formula:,} | {variant.formula / full:.2f} "
              f"| {medians[name]:.3f} | {medians[name] / medians['none']:.2f} |")


if __name__ == "__main__":
    main()
