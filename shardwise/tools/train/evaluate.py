"""After training: the validation loss and a generated sample.

Both run on every rank. In stage 3 a forward gathers each layer from all ranks, so a
rank cannot run the model alone; and generating token by token would gather the whole
model once per token. Instead the ranks gather the full weights once
(`shardwise.gathered_parameters`, which keeps them resident while the block runs) and
then compute without further communication. Every rank generates the same text from
the same seed; rank 0 writes it. The cost is one full copy of the weights per rank for
the duration, which is what consolidating a checkpoint for inference would cost too.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

import shardwise
from shardwise.tools.data import BlockSampler
from shardwise.runtime.engine import Engine
from shardwise.models import GPT

VAL_BATCHES = 4
SAMPLE_TEMPERATURE = 0.8


@contextmanager
def full_weights(engine: Engine) -> Iterator[None]:
    """The model's complete weights on every rank for the block (a collective)."""
    with shardwise.gathered_parameters(list(engine.module.parameters())):
        yield


@torch.no_grad()
def validation_loss(engine: Engine, sampler: BlockSampler, batches: int = VAL_BATCHES) -> float:
    """Mean loss over the first `batches` global batches of `sampler`, over all ranks."""
    total = torch.zeros(1, dtype=torch.float64, device=engine.device)
    count = 0
    for step in range(batches):
        for x, y in sampler.micro_batches(step, engine.rank, engine.world_size):
            total += engine(x.to(engine.device), y.to(engine.device)).double()
            count += 1
    total /= count * engine.world_size
    engine.comm.control_all_reduce(total, "validation loss")
    return float(total.item())


@torch.no_grad()
def generate_sample(model: GPT, prompt: str, max_new_tokens: int, seed: int, device: torch.device) -> str:
    """`prompt` continued byte by byte; invalid UTF-8 is shown as U+FFFD."""
    torch.manual_seed(seed)
    prompt_ids = torch.tensor([list(prompt.encode())], dtype=torch.long, device=device)
    ids = model.generate(prompt_ids, max_new_tokens, temperature=SAMPLE_TEMPERATURE)
    return bytes(ids[0].tolist()).decode("utf-8", errors="replace")
