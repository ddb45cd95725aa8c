"""What the engine makes of its arguments: checks that they fit together, and the
factories that turn an optimizer or scheduler (given, or named by the policies) into the
ones the engine drives."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from shardwise.runtime.engine.policies import OptimizerPolicy, Policies, SchedulerPolicy
from shardwise.runtime.optim.registry import optimizer_spec
from shardwise.runtime.optim.schedulers import SCHEDULERS
from shardwise.runtime.optim.torch_by_name import torch_scheduler_class


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


def check_arguments(policies: Policies, optimizer: Any, lr_scheduler: Any) -> None:
    """An optimizer and a scheduler come from the caller or from the policies (a config's
    `optimizer` / `scheduler` block), never both."""
    if optimizer is not None and policies.optimizer is not None:
        raise ValueError(
            "an optimizer was passed to initialize() and the config has an 'optimizer' block "
            f"({policies.optimizer.type}); keep one of them"
        )
    if optimizer is None and policies.optimizer is None and (lr_scheduler is not None or policies.scheduler is not None):
        raise ValueError("a learning-rate scheduler without an optimizer: pass an optimizer to initialize() or "
                         "add an 'optimizer' block (an engine without one only runs forward)")
    if lr_scheduler is not None and policies.scheduler is not None:
        raise ValueError(
            "an lr_scheduler was passed to initialize() and the config has a 'scheduler' block "
            f"({policies.scheduler.type}); keep one of them"
        )


def hidden_size(model: nn.Module) -> int | None:
    """A model's hidden width from its config (Hugging Face's `hidden_size`, GPT's `n_embd`)."""
    config = getattr(model, "config", None)
    return getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)


def optimizer_factory(
    optimizer: torch.optim.Optimizer | None, policy: OptimizerPolicy | None
) -> Callable[[list[list[torch.Tensor]]], torch.optim.Optimizer]:
    """How to get a torch optimizer over the owned segments, one list per param group."""

    def repoint(groups: list[list[torch.Tensor]]) -> torch.optim.Optimizer:
        for group, params in zip(optimizer.param_groups, groups):
            group["params"] = params
        optimizer.state.clear()
        return optimizer

    def from_policy(groups: list[list[torch.Tensor]]) -> torch.optim.Optimizer:
        return optimizer_spec(policy.type).build([{"params": params} for params in groups], dict(policy.params))

    return repoint if optimizer is not None else from_policy


def make_scheduler(lr_scheduler: Any, policy: SchedulerPolicy | None, optimizer: torch.optim.Optimizer) -> Any:
    """The policies' schedule (DeepSpeed's by name, else torch's: optim/torch_by_name.py), or
    the caller's scheduler (or a callable building one)."""
    if policy is not None:
        schedule = SCHEDULERS.get(policy.type) or torch_scheduler_class(policy.type)
        return schedule(optimizer, **policy.params)
    if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
        return lr_scheduler(optimizer)
    return lr_scheduler
