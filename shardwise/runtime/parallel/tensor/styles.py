"""Styles: what a plan entry does to the module it names.

A plan maps module names (dot-separated, each part an fnmatch pattern: `blocks.*.mlp.fc`)
to one of these styles, as torchtitan's plans and DeepSpeed's AutoTP do:

    colwise            column-parallel linear (nn.Linear or Conv1D); enters the tensor region itself
    colwise_in_region  column-parallel, its input already entered by a `region_input` module
    colwise_qkv        column-parallel over a fused q/k/v projection: each of the 3 parts split
    colwise_gather     column-parallel whose output is gathered back to full width
    rowwise            row-parallel linear; output summed (or reduce-scattered with Megatron SP)
    region_input       a module whose first input enters the region once, for all the
                       column-parallel layers inside it (q/k/v of an attention, gate/up of an MLP)
    vocab_embedding    embedding split over the vocabulary
    vocab_head         output layer split over the vocabulary; the loss never gathers its logits

A module only one model family has (shardwise GPT's attention, GPT-2's) gets a `Style`
function of that family's own (shardwise/models/) in place of a name.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from shardwise.runtime.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    ShardCache,
    TensorRegion,
    VocabParallelEmbedding,
    VocabParallelHead,
)
from shardwise.runtime.compile.blocks import traceable_hook
from shardwise.runtime.parallel.tensor.regions import enter_region

Style = Callable[[nn.Module, TensorRegion, ShardCache], nn.Module]


def _region_input(module: nn.Module, region: TensorRegion, cache: ShardCache) -> nn.Module:
    """Enter the region once at the module's input (`hidden_states` by keyword or first positional)."""

    def enter(_module: nn.Module, args: tuple, kwargs: dict):
        if "hidden_states" in kwargs:
            kwargs = {**kwargs, "hidden_states": enter_region(kwargs["hidden_states"], region.comm,
                                                              region.sequence_parallel)}
        elif args and isinstance(args[0], torch.Tensor):
            args = (enter_region(args[0], region.comm, region.sequence_parallel), *args[1:])
        else:
            raise TypeError(f"{type(_module).__name__}: no hidden_states input to enter the tensor region with")
        return args, kwargs

    module.register_forward_pre_hook(traceable_hook(enter), with_kwargs=True)  # compiled with its block
    return module


STYLES: dict[str, Style] = {
    "colwise": lambda m, r, c: ColumnParallelLinear(m, r, c),
    "colwise_in_region": lambda m, r, c: ColumnParallelLinear(m, r, c, enter=False),
    "colwise_qkv": lambda m, r, c: ColumnParallelLinear(m, r, c, blocks=3),
    "colwise_gather": lambda m, r, c: ColumnParallelLinear(m, r, c, gather_output=True),
    "rowwise": lambda m, r, c: RowParallelLinear(m, r, c),
    "region_input": _region_input,
    "vocab_embedding": lambda m, r, c: VocabParallelEmbedding(m, r, c),
    # after the decoder stack, where sequence parallelism has made the sequence whole again
    "vocab_head": lambda m, r, c: VocabParallelHead(m, TensorRegion(r.comm), c),
}


def style(name: str | Style, key: str) -> Style:
    """The style called `name` (or `name` itself, a family's own style function); `key`
    names where it came from, for the error."""
    if callable(name):
        return name
    if name not in STYLES:
        raise ValueError(f"{key}: unknown tensor-parallel style {name!r}; the styles are {', '.join(STYLES)}")
    return STYLES[name]
