"""Saved-activation bytes of shardwise GPT's decoder layers under tensor parallelism, with
and without Megatron sequence parallelism (issue 10 item 3).

Every tensor autograd saves during one training forward is seen by
`torch.autograd.graph.saved_tensors_hooks`; it is attributed to the innermost module
running when it was saved (LayerNorm, Dropout, ColumnParallelLinear, ...). Parameters are
left out (they are not activations), and a storage saved twice (q/k/v reading one input)
is counted once, as memory is.
"""

from __future__ import annotations

import dataclasses

import torch

import shardwise
from shardwise.models.gpt import GPT, GPTConfig

BATCH, SEQ, WIDTH, HEADS, LAYERS, VOCAB = 2, 16, 32, 2, 2, 64


def saved_bytes_by_module(rank: int, world_size: int, sequence_parallel: bool, batch: int = BATCH, seq: int = SEQ,
                          width: int = WIDTH, heads: int = HEADS, layers: int = LAYERS) -> dict[str, int]:
    """Saved bytes by module type over one forward (+ the backward, which must run)."""
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=VOCAB, block_size=seq, n_layer=layers, n_head=heads, n_embd=width, dropout=0.1)
    model = GPT(dataclasses.replace(config, bias=True))
    shardwise.initialize(model, {
        "train_micro_batch_size_per_gpu": batch, "zero_optimization": {"stage": 0},
        "tensor_parallel": {"size": world_size, "sequence_parallel": sequence_parallel}},
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    running: list[str] = []
    seen: dict[int, tuple[str, int]] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters and running:
            seen.setdefault(storage.data_ptr(), (running[-1], storage.nbytes()))
        return tensor

    def enter(module: torch.nn.Module, args: tuple) -> None:
        running.append(type(module).__name__)

    def leave(module: torch.nn.Module, args: tuple, output: object) -> None:
        running.pop()

    for module in model.blocks.modules():
        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (batch, seq + 1), generator=generator)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(tokens[:, :-1], tokens[:, 1:])  # the model itself: the engine's forward has its own hooks
    totals: dict[str, int] = {}
    for kind, nbytes in seen.values():
        totals[kind] = totals.get(kind, 0) + nbytes
    loss.backward()  # the re-gathering backward runs
    return totals
