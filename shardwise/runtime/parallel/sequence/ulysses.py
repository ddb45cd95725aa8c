"""Ulysses sequence parallelism (Jacobs et al., 2023): the "sequence" step of a model's
`parallelize` (shardwise/models/).

The user gives each data-parallel rank whole sequences, as without it. Inside forward,
the decoder layers of each of the S ranks of the sequence group run on 1/S of the
positions (stack.py splits at the first layer); attention exchanges sequence shards for
head shards by an all-to-all before the attention kernel and back after it
(all_to_all.py), so every head still sees every position. After the last layer the
sequence is whole again (an all-gather), and the final norm, the output layer and the
model's own loss run on it: the loss is the model's mean over the full sequence, exactly.

Gradients: the parameters are replicated over the sequence group and ZeRO averages
gradients over data x sequence ranks (the mesh's shard group). Each sequence rank's
decoder gradients are its positions' share, so the all-gather's backward scales the
gradient by S: the average over S then gives the sum of shares for the decoder and the
mean of S equal copies for the layers after the gather. No other change to ZeRO.

Attention: the model family says how its attention does the exchange (shardwise GPT's
attention module does it itself; Hugging Face models get an attention function wrapping
the model's own through `AttentionInterface`, as DeepSpeed's UlyssesSPAttentionHF does),
using `ulysses_attention` here. Grouped-query attention: KV heads divisible by S are
exchanged as they are; fewer KV heads than S (S a multiple of them) are repeated to S
heads first; anything else is an error with the numbers.

With tensor parallelism (applied first) each tensor rank holds heads / T of the heads and
its layers run on the positions of its sequence rank: Ulysses exchanges those local heads
over the sequence group, and the tensor group's collectives carry 1/S of the positions
inside the decoder layers. The two groups are disjoint dimensions of the mesh.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from shardwise.runtime.distributed.collectives import Communicator
from shardwise.runtime.parallel.sequence.all_to_all import heads_to_sequence, sequence_to_heads
from shardwise.runtime.parallel.sequence.stack import decoder_layers, join_at_exit, split_at_entry
from shardwise.runtime.parallel.tensor.plans import TensorPlan

KEY = "sequence_parallel.size"


class _GatherScaled(torch.autograd.Function):
    """Forward: the whole sequence from every rank's chunk. Backward: this rank's chunk of
    the gradient times S (see the module docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        ctx.comm = comm
        moved = x.movedim(1, 0).contiguous()
        full = moved.new_empty((comm.size * moved.shape[0], *moved.shape[1:]))
        comm.all_gather(full.view(-1), moved.view(-1), "sequence chunks after the last decoder layer").wait()
        return full.movedim(0, 1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.chunk(ctx.comm.size, 1)[ctx.comm.rank] * ctx.comm.size, None


def own_positions(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """This rank's chunk of positions (dimension 1); backward puts zeros elsewhere."""
    if x.shape[1] % comm.size:
        raise ValueError(f"{KEY} {comm.size} must divide the sequence length {x.shape[1]}: each rank of the "
                         "sequence group takes an equal chunk of positions")
    return x.chunk(comm.size, 1)[comm.rank]


def check_heads(plan: TensorPlan, size: int, tensor_size: int = 1) -> None:
    """Each tensor rank holds heads / T of the heads (tensor parallelism splits them first);
    Ulysses shares those over the sequence group."""
    heads = None if plan.heads is None else plan.heads // tensor_size
    held = "" if tensor_size == 1 else f" that each rank of tensor_parallel.size {tensor_size} holds"
    if heads is not None and (heads == 0 or heads % size):
        raise ValueError(f"{KEY} {size} must divide the model's {heads} attention heads{held}: Ulysses gives each "
                         "rank of the sequence group an equal share of the heads")
    kv = None if plan.kv_heads is None else max(plan.kv_heads // tensor_size, 1)
    if kv is not None and kv % size and size % kv:
        raise ValueError(f"{KEY} {size} and the model's {kv} key/value heads{held}: one must divide the other (KV "
                         "heads are split over the sequence group, or repeated when there are fewer than its size)")


class _WithGroups:
    """The attention module as the wrapped attention function sees it, with the query
    heads per KV head after KV heads were repeated."""

    def __init__(self, module: nn.Module, groups: int):
        self._module, self.num_key_value_groups = module, groups

    def __getattr__(self, name: str):
        return getattr(self._module, name)


def ulysses_attention(inner, comm: Communicator):
    """An attention function (Hugging Face's signature, (batch, heads, s/S, dim) inputs)
    that runs `inner` on whole sequences of 1/S of the heads."""

    def attention(module: nn.Module, query, key, value, attention_mask, **kwargs):
        heads, kv_heads = query.shape[1], key.shape[1]
        if kv_heads % comm.size:
            repeat = comm.size // kv_heads
            key, value = (t.repeat_interleave(repeat, dim=1) for t in (key, value))
            module = _WithGroups(module, heads // comm.size)
        q, k, v = (sequence_to_heads(t.transpose(1, 2), comm).transpose(1, 2) for t in (query, key, value))
        output, weights = inner(module, q, k, v, attention_mask, **kwargs)
        return heads_to_sequence(output, comm), weights

    return attention


def apply_ulysses(model: nn.Module, comm: Communicator, plan: TensorPlan, *,
                  exchange_in_attention: Callable[[nn.ModuleList, Communicator], None],
                  split_kwargs: tuple[str, ...] = (), tensor_size: int = 1) -> nn.Module:
    """Split `model`'s decoder (`plan.layers`) over the sequence group `comm` (see the
    module docstring); `exchange_in_attention(layers, comm)` is the family's way of making
    its attention exchange sequence for heads. `split_kwargs`: whole-sequence inputs every
    layer receives (Hugging Face's rotary `position_embeddings`), cut to this rank's
    positions. With tensor parallelism (applied before), over the heads each tensor rank holds."""
    layers, _ = decoder_layers(model, plan, "Ulysses sequence parallelism")
    check_heads(plan, comm.size, tensor_size)
    exchange_in_attention(layers, comm)
    split_at_entry(layers, lambda hidden: own_positions(hidden, comm), split_kwargs,
                   lambda value: own_positions(value, comm) if value.dim() >= 2 else value)
    join_at_exit(layers, lambda hidden: _GatherScaled.apply(hidden, comm))
    return model
