"""Optimizers and schedules named in a DeepSpeed config, built from torch's own classes.

Which torch class a DeepSpeed `optimizer.type` means (its "Adam" decouples weight decay
unless `adam_w_mode` is false) is decided by the config (`OptimizerConfig`); here the
class is built, with torch's fused kernel, which exists on CPU and CUDA for all three.
"""

from __future__ import annotations

from typing import Any

import torch

from shardwise.config import OptimizerConfig, SchedulerConfig
from shardwise.optim.schedulers import SCHEDULERS


def build_optimizer(param_groups: list[dict[str, Any]], config: OptimizerConfig) -> torch.optim.Optimizer:
    """A torch optimizer over `param_groups` (each a dict with "params")."""
    cls = getattr(torch.optim, config.torch_class_name)
    kwargs = config.torch_kwargs()
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    return cls(param_groups, fused=True, **kwargs)


def build_scheduler(optimizer: torch.optim.Optimizer, config: SchedulerConfig) -> Any:
    """One of DeepSpeed's warm-up schedules, stepped by the engine after each update."""
    return SCHEDULERS[config.type](optimizer, **config.params)
