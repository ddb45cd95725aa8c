"""How a model tells the engine about expert parallelism, without the engine knowing any
particular MoE layer: a layer with experts split over P ranks says so with
`expert_parallel_size`, takes its groups through `use_expert_groups` and names its
experts as the every-expert layer would (`global_expert_name`); its expert
parameters carry the size (`mark_expert_parameters`), so the engine trains them apart
from the dense ones (training.py)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import nn

from shardwise.runtime.distributed.collectives import Communicator

EXPERT_ATTRIBUTE = "_shardwise_expert_parallel"


@runtime_checkable
class ExpertParallelLayer(Protocol):
    expert_parallel_size: int

    def use_expert_groups(self, expert: Communicator) -> None:
        """Exchange tokens over `expert` (this rank's expert group) from now on."""

    def global_expert_name(self, name: str) -> str:
        """The name that the layer's expert parameter `name` (relative to the layer, as
        this rank holds it) has in the same layer holding every expert: checkpoints store
        experts under it, so they can be regrouped at another expert-parallel size."""


def mark_expert_parameters(module: nn.Module, size: int) -> None:
    """Mark every parameter of `module` as an expert's, split over `size` ranks."""
    for param in module.parameters():
        setattr(param, EXPERT_ATTRIBUTE, size)


def expert_parallel_size(param: torch.Tensor) -> int | None:
    """The expert-parallel size of an expert's parameter; None for a dense one."""
    return getattr(param, EXPERT_ATTRIBUTE, None)
