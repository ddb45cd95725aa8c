"""A plain DeepSpeed-style GPT training script: the script `shardwise tune` tunes in
benchmarks/autotune.py and tests/tools/planner/test_tune.py.

    shardwise run --nproc 2 benchmarks/autotune_gpt.py --deepspeed_config ds.json --preset 10m --seq-len 128

It reads everything it can vary from the config (micro-batch, accumulation, pipeline) as
a DeepSpeed script does through its engine, and trains for `--steps` steps on random
tokens: under the autotuner the engine stops it after end_profile_step.
"""

from __future__ import annotations

import argparse

import torch

import shardwise
from shardwise.models import GPT, GPTConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deepspeed_config", required=True)
    parser.add_argument("--preset", default="10m")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(1234)
    config = GPTConfig.preset(args.preset)
    engine = shardwise.initialize(GPT(config), args.deepspeed_config)
    micro_batch = engine.train_micro_batch_size_per_gpu()
    accumulation = engine.config.gradient_accumulation_steps
    generator = torch.Generator().manual_seed(engine.global_rank)

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, config.vocab_size, (micro_batch, args.seq_len + 1), generator=generator)
        return tokens[:, :-1], tokens[:, 1:]

    for _ in range(args.steps):
        if engine.pipeline is not None:
            engine.train_batch(iter([batch() for _ in range(accumulation)]), loss_fn=_next_token_loss)
            continue
        for _ in range(accumulation):
            inputs, targets = batch()
            engine.backward(engine(inputs, targets))
            engine.step()


def _next_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))


if __name__ == "__main__":
    main()
