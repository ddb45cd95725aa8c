"""A training script for the elastic test (test_elastic.py), run by `shardwise run`.

It has no resume logic of its own: the config's `auto_resume` makes `initialize` load the
newest checkpoint of CKPT, and the loop continues from `engine.global_steps`. Each step's
global batch is fixed by the step number (GLOBAL samples), split among whatever ranks
there are, so any world size sees the same samples per step. It saves every 2 steps and
appends (restarted, world size, step, loss) to rank<r>.jsonl. On the first start, the
process whose environment has ELASTIC_KILL_AFTER=N kills its own launcher (a node lost)
after step N.

usage: elastic_worker.py OUT CKPT STEPS
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import shardwise

GLOBAL, FEATURES = 12, 8


def batch(step: int, rank: int, world: int, micro: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch `index` of this rank at `step`: rows of the step's global batch."""
    data = torch.Generator().manual_seed(1000 + step)
    inputs = torch.randn(GLOBAL, FEATURES, generator=data)
    targets = torch.randn(GLOBAL, 1, generator=data)
    rows = torch.arange(GLOBAL).view(-1, world, micro)[index, rank]  # [accumulation, rank, micro]
    return inputs[rows], targets[rows]


def main() -> None:
    out, ckpt, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    kill_after = int(os.environ.get("ELASTIC_KILL_AFTER", "0"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    config = {
        "train_batch_size": GLOBAL, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 3,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "eps": 1e-4}},
        "zero_optimization": {"stage": 3},
        "auto_resume": {"checkpoint_dir": ckpt},
    }
    engine = shardwise.initialize(model, config)
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(engine.resumed_client_state is not None)  # torchrun's restart count is each node's own
    log = Path(out) / f"rank{rank}.jsonl"
    while engine.global_steps < steps:
        step = engine.global_steps
        total = torch.zeros(())
        for index in range(engine.gradient_accumulation_steps):
            inputs, targets = batch(step, rank, world, engine.policies.training.micro_batch_size, index)
            loss = torch.nn.functional.mse_loss(engine(inputs), targets)
            engine.backward(loss)
            engine.step()  # applies the update at the last micro-batch (DeepSpeed's rule)
            total += loss.detach()
        dist.all_reduce(total)
        mean = total.item() / (world * engine.gradient_accumulation_steps)
        with log.open("a") as lines:
            lines.write(json.dumps({"restart": restart, "world": world, "step": step + 1, "loss": mean}) + "\n")
        if engine.global_steps % 2 == 0:
            engine.save_checkpoint(ckpt, tag=f"step{engine.global_steps}", client_state={"world": world})
        if restart == 0 and engine.global_steps == kill_after:
            os.kill(os.getppid(), signal.SIGKILL)  # the launcher: its node is gone (its worker dies with it)
            time.sleep(60)
    engine.destroy()


if __name__ == "__main__":
    main()
