"""Optimizers and schedules named in a DeepSpeed config.

Which optimizer a config's `optimizer.type` means, and how to build it, is the registry's
(optim/registry.py); which schedule, `SCHEDULERS`'.
"""

from __future__ import annotations

from typing import Any

import torch

from shardwise.frontends.deepspeed.config import OptimizerConfig, SchedulerConfig
from shardwise.runtime.optim.registry import optimizer_spec
from shardwise.runtime.optim.schedulers import SCHEDULERS


def build_optimizer(param_groups: list[dict[str, Any]], config: OptimizerConfig) -> torch.optim.Optimizer:
    """The config's optimizer over `param_groups` (each a dict with "params")."""
    return optimizer_spec(config.type).build(param_groups, dict(config.params))


def build_scheduler(optimizer: torch.optim.Optimizer, config: SchedulerConfig) -> Any:
    """One of DeepSpeed's warm-up schedules, stepped by the engine after each update."""
    return SCHEDULERS[config.type](optimizer, **config.params)
