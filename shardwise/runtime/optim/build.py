"""Optimizers and schedules named in a DeepSpeed config.

Which optimizer a config's `optimizer.type` means, and how to build it, is the registry's
(optim/registry.py); which schedule, `SCHEDULERS`'. Both take the config's resolved block
(frontends/deepspeed/config: `OptimizerConfig`, `SchedulerConfig`), read through
`TypedBlock` so that the runtime does not import the front end.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol

import torch

from shardwise.runtime.optim.registry import optimizer_spec
from shardwise.runtime.optim.schedulers import SCHEDULERS


class TypedBlock(Protocol):
    """A config block naming a class by `type`, with its resolved `params`."""

    @property
    def type(self) -> str: ...

    @property
    def params(self) -> Mapping[str, Any]: ...


def build_optimizer(param_groups: list[dict[str, Any]], config: TypedBlock) -> torch.optim.Optimizer:
    """The config's optimizer over `param_groups` (each a dict with "params")."""
    return optimizer_spec(config.type).build(param_groups, dict(config.params))


def build_scheduler(optimizer: torch.optim.Optimizer, config: TypedBlock) -> Any:
    """One of DeepSpeed's warm-up schedules, stepped by the engine after each update."""
    return SCHEDULERS[config.type](optimizer, **config.params)
