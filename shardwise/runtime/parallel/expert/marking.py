"""How a model tells the engine about expert parallelism, without the engine knowing any
particular MoE layer: a layer with experts split over P ranks says so with
`expert_parallel_size`, takes its groups through `use_expert_groups` and places its
experts in the every-expert layer (`global_expert_place`: that layer's parameter, and
where this rank's part starts in it); its expert
parameters carry the size (`mark_expert_parameters`), so the engine trains them apart
from the dense ones (training.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from shardwise.runtime.distributed.collectives import Communicator

EXPERT_ATTRIBUTE = "_shardwise_expert_parallel"


@dataclass(frozen=True)
class ExpertPlace:
    """Where an expert parameter, as a rank holds it, lies in the every-expert model: in
    that model's parameter `name` of `shape`, from flat element `offset` on. An expert
    kept as a parameter of its own is the whole of one (offset 0); a slice of stacked
    experts (E, ...) is a range of the stacked tensor. Checkpoints store experts by this
    place, so any layout reads whichever part it holds."""

    name: str
    shape: tuple[int, ...]
    offset: int = 0

    def under(self, path: str) -> "ExpertPlace":
        """The place with the layer's module path before the name."""
        return ExpertPlace(f"{path}.{self.name}" if path else self.name, self.shape, self.offset)


@runtime_checkable
class ExpertParallelLayer(Protocol):
    expert_parallel_size: int

    def use_expert_groups(self, expert: Communicator) -> None:
        """Exchange tokens over `expert` (this rank's expert group) from now on."""

    def global_expert_place(self, name: str) -> ExpertPlace:
        """Where the layer's expert parameter `name` (relative to the layer, as this rank
        holds it) lies in the same layer holding every expert: checkpoints store experts
        there, so they can be regrouped at another expert-parallel size."""


def mark_expert_parameters(module: nn.Module, size: int) -> None:
    """Mark every parameter of `module` as an expert's, split over `size` ranks."""
    for param in module.parameters():
        setattr(param, EXPERT_ATTRIBUTE, size)


def expert_parallel_size(param: torch.Tensor) -> int | None:
    """The expert-parallel size of an expert's parameter; None for a dense one."""
    return getattr(param, EXPERT_ATTRIBUTE, None)
