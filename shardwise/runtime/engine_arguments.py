"""What `initialize` makes of its arguments: checks that they fit together, and the
factories that turn an optimizer or scheduler (given, or named in the config) into the
ones the engine drives."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from shardwise.frontends.deepspeed.config import ShardwiseConfig
from shardwise.runtime.optim import build_scheduler
from shardwise.runtime.optim.registry import optimizer_spec


def refuse_second_engine(model: nn.Module) -> None:
    """A second engine on the same parameters would add a second set of gradient hooks:
    every gradient reduced twice, silently."""
    for param in model.parameters():
        reference = getattr(param, "_shardwise_hooks", None)
        if reference is not None and reference() is not None:
            raise RuntimeError(
                "this model is already trained by a shardwise engine (initialize was called on "
                "it before); call engine.destroy() on the first engine, or build a new model"
            )


def check_arguments(cfg: ShardwiseConfig, optimizer: Any, lr_scheduler: Any) -> None:
    if optimizer is not None and cfg.optimizer is not None:
        raise ValueError(
            "an optimizer was passed to initialize() and the config has an 'optimizer' "
            "block; keep one of them"
        )
    if optimizer is None and cfg.optimizer is None and (lr_scheduler is not None or cfg.scheduler is not None):
        raise ValueError("a learning-rate scheduler without an optimizer: pass an optimizer to initialize() or "
                         "add an 'optimizer' block (an engine without one only runs forward)")
    if lr_scheduler is not None and cfg.scheduler is not None:
        raise ValueError(
            "an lr_scheduler was passed to initialize() and the config has a 'scheduler' "
            "block; keep one of them"
        )


def hidden_size(model: nn.Module) -> int | None:
    config = getattr(model, "config", None)
    return getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)


def group_lookup(optimizer: torch.optim.Optimizer | None) -> Callable[[nn.Parameter], int | None]:
    groups = {id(p): index for index, group in enumerate(optimizer.param_groups) for p in group["params"]} if optimizer else {}
    return lambda param: groups.get(id(param))


def optimizer_factory(
    optimizer: torch.optim.Optimizer | None, cfg: ShardwiseConfig
) -> Callable[[list[list[torch.Tensor]]], torch.optim.Optimizer]:
    """How to get a torch optimizer over the owned segments, one list per param group."""

    def repoint(groups: list[list[torch.Tensor]]) -> torch.optim.Optimizer:
        for group, params in zip(optimizer.param_groups, groups):
            group["params"] = params
        optimizer.state.clear()
        return optimizer

    def from_config(groups: list[list[torch.Tensor]]) -> torch.optim.Optimizer:
        return optimizer_spec(cfg.optimizer.type).build([{"params": params} for params in groups], cfg.optimizer.params)

    return repoint if optimizer is not None else from_config


def make_scheduler(lr_scheduler: Any, cfg: ShardwiseConfig, optimizer: torch.optim.Optimizer) -> Any:
    if cfg.scheduler is not None:
        return build_scheduler(optimizer, cfg.scheduler)
    if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
        return lr_scheduler(optimizer)
    return lr_scheduler
