"""DeepSpeed's warm-up learning-rate schedules, stepped once per optimizer step.

The formulas (log or linear warm-up from a minimum to a maximum, then constant, linear
decay or cosine decay), their defaults, and their start (construction sets the rate of
iteration -1: the minimum, so the first update runs at warmup_min_lr) match DeepSpeed's
`lr_schedules.py`, so a DeepSpeed config trains with the same learning rates.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any

import torch


class _WarmupSchedule(ABC):
    """Shared mechanics: `last_batch_iteration` counts optimizer steps taken so far."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_num_steps: int, warmup_type: str):
        if warmup_type not in ("log", "linear"):
            raise ValueError(f"warmup_type must be 'log' or 'linear', got {warmup_type!r}")
        self.optimizer = optimizer
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        self.last_batch_iteration = -1

    def _warmup_fraction(self) -> float:
        """0 -> 1 over the warm-up steps, logarithmic or linear."""
        if self.warmup_type == "log":
            return math.log(self.last_batch_iteration + 1) / math.log(self.warmup_num_steps)
        return self.last_batch_iteration / self.warmup_num_steps

    @abstractmethod
    def get_lr(self) -> list[float]:
        """The learning rate of every param group at `last_batch_iteration`."""

    def step(self, last_batch_iteration: int | None = None) -> None:
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        for group, lr in zip(self.optimizer.param_groups, self.get_lr()):
            group["lr"] = lr

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step(state["last_batch_iteration"])


class WarmupLR(_WarmupSchedule):
    """min_lr -> max_lr over `warmup_num_steps`, then constant at max_lr."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        warmup_min_lr: float = 0.0,
        warmup_max_lr: float | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ):
        """`warmup_max_lr=None` warms up to the optimizer's (first group's) lr."""
        super().__init__(optimizer, warmup_num_steps, warmup_type)
        self.min_lr = warmup_min_lr
        self.max_lr = optimizer.param_groups[0]["lr"] if warmup_max_lr is None else warmup_max_lr
        self.step(last_batch_iteration)

    def _gamma(self) -> float:
        if self.last_batch_iteration < 0:
            return 0.0
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_fraction()
        return 1.0

    def get_lr(self) -> list[float]:
        lr = self.min_lr + (self.max_lr - self.min_lr) * self._gamma()
        return [lr] * len(self.optimizer.param_groups)


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to 0 at `total_num_steps`."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_lr: float = 0.0,
        warmup_max_lr: float | None = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ):
        self.total_num_steps = total_num_steps
        super().__init__(
            optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
            last_batch_iteration,
        )

    def _gamma(self) -> float:
        if self.last_batch_iteration < 0:
            return 0.0
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_fraction()
        remaining = self.total_num_steps - self.last_batch_iteration
        return max(0.0, remaining / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(_WarmupSchedule):
    """Ratio of each group's initial lr: warm-up from `warmup_min_ratio` to 1, then a
    cosine down to `cos_min_ratio` at `total_num_steps`."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ):
        super().__init__(optimizer, warmup_num_steps, warmup_type)
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.cos_min_ratio = cos_min_ratio
        self.base_lrs = [group.setdefault("initial_lr", group["lr"]) for group in optimizer.param_groups]
        self.step(last_batch_iteration)

    def _ratio(self) -> float:
        if self.last_batch_iteration < 0:
            return 0.0
        if self.last_batch_iteration < self.warmup_num_steps:
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * self._warmup_fraction()
        done = self.last_batch_iteration - self.warmup_num_steps + 1
        span = max(1, self.total_num_steps - self.warmup_num_steps)
        cosine = (1 + math.cos(math.pi * done / span)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:
        ratio = self._ratio()
        return [base * ratio for base in self.base_lrs]


SCHEDULERS = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR}
