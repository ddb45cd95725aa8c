"""Hooks at the edges of a decoder stack: where the sequence is split and where it is whole again.

Both sequence parallelisms run the decoder layers on 1/N of each sequence without editing
the model: a forward pre-hook on the first layer replaces its input `hidden_states` by this
rank's chunk of positions, and (Ulysses) a forward hook on the last layer replaces its
output by the whole sequence again. Hugging Face decoders also pass every layer the rotary
`position_embeddings` of the whole sequence; `split_kwargs` names such inputs, which are cut
to the same positions at every layer.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from shardwise.runtime.parallel.tensor.plans import TensorPlan

Cut = Callable[[torch.Tensor], torch.Tensor]


def decoder_layers(model: nn.Module, plan: TensorPlan | None, what: str) -> tuple[nn.ModuleList, nn.Module | None]:
    """The plan's decoder layers and final norm; `what` names the feature for the error."""
    if plan is None or plan.layers is None:
        raise ValueError(f"{what} needs to know where {type(model).__name__}'s decoder layers are: give them in "
                         "the model's plan (shardwise.models.ModelPlan(layers=...), docs/parallelism.md)")
    final = model.get_submodule(plan.final_norm) if plan.final_norm else None
    return model.get_submodule(plan.layers), final


def _replace_hidden(args: tuple, kwargs: dict, change: Cut) -> tuple[tuple, dict]:
    if "hidden_states" in kwargs:
        return args, {**kwargs, "hidden_states": change(kwargs["hidden_states"])}
    return (change(args[0]), *args[1:]), kwargs


def split_at_entry(layers: nn.ModuleList, split: Cut, split_kwargs: tuple[str, ...] = (),
                   cut_positions: Cut | None = None) -> None:
    """The first layer receives this rank's chunk; with `split_kwargs`, every layer's
    whole-sequence inputs of those names are cut by `cut_positions` (sequence dim 1)."""

    def first(module: nn.Module, args: tuple, kwargs: dict):
        return _replace_hidden(args, kwargs, split)

    layers[0].register_forward_pre_hook(first, with_kwargs=True)
    if not split_kwargs:
        return

    def every(module: nn.Module, args: tuple, kwargs: dict):
        changed = dict(kwargs)
        for name in split_kwargs:
            value = kwargs.get(name)
            if isinstance(value, tuple):
                changed[name] = tuple(cut_positions(part) for part in value)
            elif isinstance(value, torch.Tensor):
                changed[name] = cut_positions(value)
        return args, changed

    for layer in layers:
        layer.register_forward_pre_hook(every, with_kwargs=True)


def join_at_exit(layers: nn.ModuleList, join: Cut) -> None:
    """The last layer's output (a tensor, or a tuple whose first item is one) is joined."""

    def last(module: nn.Module, args: tuple, output):
        if isinstance(output, tuple):
            return (join(output[0]), *output[1:])
        return join(output)

    layers[-1].register_forward_hook(last)
