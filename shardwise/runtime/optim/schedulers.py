"""DeepSpeed's learning-rate schedules, stepped once per applied optimizer step.

WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle and LRRangeTest compute what DeepSpeed
0.19.8's `runtime/lr_schedules.py` computes, in the same floating-point order, so a
DeepSpeed config trains with the same learning rate at every step: construction sets the
rate of iteration -1 (the warm-up's minimum, OneCycle's and the range test's minimum), so
the first update runs at it; the warm-up lasts `max(2, warmup_num_steps)` steps; a
scalar setting applies to every param group and a list gives one value per group; and
the engine steps the schedule after each optimizer step it applies (not after one an
fp16 overflow skipped), as DeepSpeed's engine does. A group whose lr is a tensor keeps that
tensor (filled in place), so a caller holding it sees every new rate; an unknown
`warmup_type` warns and warms up logarithmically, and `warmup_num_steps` must be a positive
integer, as in DeepSpeed.
tests/runtime/optim/test_schedulers.py compares every step with DeepSpeed's own classes.
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from typing import Any, Sequence

import torch

WARMUP_TYPES = ("log", "linear")
log = logging.getLogger("shardwise")


def warn_short_total(total_num_steps: int, warmup_num_steps: int) -> None:
    """A schedule that ends before its warm-up does: DeepSpeed warns and runs it (the rate
    decays from wherever the warm-up got to), and so does shardwise."""
    if total_num_steps < warmup_num_steps:
        log.warning("scheduler total_num_steps %d is less than warmup_num_steps %d", total_num_steps,
                    warmup_num_steps)


def per_group(optimizer: torch.optim.Optimizer, value: float | Sequence[float], name: str) -> list[float]:
    """A scalar for every param group, or a list with one value per group."""
    if isinstance(value, (list, tuple)):
        if len(value) != len(optimizer.param_groups):
            raise ValueError(f"{name} has {len(value)} values for {len(optimizer.param_groups)} param groups")
        return list(value)
    return [value] * len(optimizer.param_groups)


def set_lr(group: dict[str, Any], lr: float | torch.Tensor) -> None:
    """Write `lr` into a param group: in place into a tensor lr (its identity, shape and
    dtype kept: optimizers built with a tensor lr, and callers holding it, read that
    tensor), else as the number."""
    if torch.is_tensor(group["lr"]):
        group["lr"].fill_(lr.squeeze() if torch.is_tensor(lr) else lr)
    else:
        group["lr"] = lr


def number(lr: float | torch.Tensor) -> float:
    """A group's lr as a number: a tensor lr is read once (it is filled in place later)."""
    return lr.item() if torch.is_tensor(lr) else lr


class _Schedule(ABC):
    """Shared mechanics: `last_batch_iteration` counts optimizer steps taken so far;
    `step()` moves it on and writes every group's rate."""

    def __init__(self, optimizer: torch.optim.Optimizer, last_batch_iteration: int):
        self.optimizer = optimizer
        self.last_batch_iteration = last_batch_iteration

    @abstractmethod
    def get_lr(self) -> list[float]:
        """The learning rate of every param group at `last_batch_iteration`."""

    def _write(self) -> None:
        for group, lr in zip(self.optimizer.param_groups, self.get_lr()):
            set_lr(group, lr)

    def step(self, last_batch_iteration: int | None = None) -> None:
        self.last_batch_iteration = self.last_batch_iteration + 1 if last_batch_iteration is None else last_batch_iteration
        self._write()

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step(state["last_batch_iteration"])


class _Warmup(_Schedule):
    """The warm-up shared by WarmupLR and WarmupCosineLR: 0 -> 1 over `warmup_num_steps`
    (at least 2), logarithmic or linear."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_num_steps: int, warmup_type: str,
                 last_batch_iteration: int):
        if isinstance(warmup_num_steps, bool) or not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
            raise ValueError(f"warmup_num_steps must be a positive integer, got {warmup_num_steps!r}")
        if warmup_type not in WARMUP_TYPES:
            log.warning("unknown warmup_type %r: warming up logarithmically ('log'), as DeepSpeed does", warmup_type)
            warmup_type = "log"
        super().__init__(optimizer, last_batch_iteration)
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)

    def _warmup_fraction(self) -> float:
        if self.warmup_type == "log":
            return self.inverse_log_warm_up * math.log(self.last_batch_iteration + 1)
        return self.last_batch_iteration / self.warmup_num_steps


class WarmupLR(_Warmup):
    """min_lr -> max_lr over `warmup_num_steps`, then constant at max_lr."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_min_lr: float | Sequence[float] = 0.0,
                 warmup_max_lr: float | Sequence[float] | None = None, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1):
        """`warmup_max_lr=None` warms each group up to its own lr."""
        super().__init__(optimizer, warmup_num_steps, warmup_type, last_batch_iteration)
        if warmup_max_lr is None:
            warmup_max_lr = [number(group["lr"]) for group in optimizer.param_groups]
        self.min_lrs = per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self.delta_lrs = [high - low for high, low in zip(self.max_lrs, self.min_lrs)]
        if last_batch_iteration == -1:
            self._write()

    def _gamma(self) -> float:
        return self._warmup_fraction() if self.last_batch_iteration < self.warmup_num_steps else 1.0

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [low + delta * gamma for low, delta in zip(self.min_lrs, self.delta_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to 0 at `total_num_steps`."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int,
                 warmup_min_lr: float | Sequence[float] = 0.0, warmup_max_lr: float | Sequence[float] | None = 0.001,
                 warmup_num_steps: int = 1000, warmup_type: str = "log", last_batch_iteration: int = -1):
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)
        warn_short_total(total_num_steps, self.warmup_num_steps)

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_fraction()
        return max(0.0, float(self.total_num_steps - self.last_batch_iteration)
                   / float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(_Warmup):
    """Ratio of each group's lr at construction: warm-up from `warmup_min_ratio` to 1, then
    a cosine down to `cos_min_ratio` at `total_num_steps`, where it stays."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001, warmup_type: str = "log",
                 last_batch_iteration: int = -1):
        super().__init__(optimizer, warmup_num_steps, warmup_type, last_batch_iteration)
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.cos_min_ratio = cos_min_ratio
        warn_short_total(total_num_steps, self.warmup_num_steps)
        self.org_lrs = [number(group["lr"]) for group in optimizer.param_groups]
        if last_batch_iteration == -1:
            self._write()

    def get_lr_ratio(self) -> float:
        """The fraction of each group's construction-time lr at `last_batch_iteration`."""
        if self.last_batch_iteration < 0:
            return 0.0
        if self.last_batch_iteration < self.warmup_num_steps:
            return self.warmup_min_ratio + self._warmup_fraction() * (1.0 - self.warmup_min_ratio)
        done = self.last_batch_iteration - self.warmup_num_steps + 1
        progress = min(1.0, done / max(1, self.total_num_steps - self.warmup_num_steps))
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return [0.0 for _ in self.org_lrs]
        ratio = self.get_lr_ratio()
        return [base * ratio for base in self.org_lrs]


class LRRangeTest(_Schedule):
    """The learning-rate range test: from `lr_range_test_min_lr`, the rate grows by
    `step_rate` x min_lr every `step_size` steps, continuously or (`staircase`) in stairs."""

    def __init__(self, optimizer: torch.optim.Optimizer, lr_range_test_min_lr: float | Sequence[float] = 1e-3,
                 lr_range_test_step_size: int = 2000, lr_range_test_step_rate: float = 1.0,
                 lr_range_test_staircase: bool = False, last_batch_iteration: int = -1):
        if isinstance(lr_range_test_step_size, bool) or not isinstance(lr_range_test_step_size, int) \
                or lr_range_test_step_size <= 0:
            raise ValueError(f"lr_range_test_step_size must be a positive integer, got {lr_range_test_step_size}")
        super().__init__(optimizer, last_batch_iteration)
        self.min_lr = per_group(optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size = lr_range_test_step_size
        self.step_rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        if last_batch_iteration == -1:
            for group, lr in zip(optimizer.param_groups, self.min_lr):
                set_lr(group, lr)

    def _interval(self) -> float:
        steps = float(self.last_batch_iteration + 1) / self.step_size
        return math.floor(steps) if self.staircase else steps

    def get_lr(self) -> list[float]:
        increase = 1 + self.step_rate * self._interval()
        return [low * increase for low in self.min_lr]


class OneCycle(_Schedule):
    """1Cycle: the rate climbs from `cycle_min_lr` to `cycle_max_lr` over
    `cycle_first_step_size` steps and back over `cycle_second_step_size` (default: the same),
    optionally in stairs; then, with `decay_step_size` and `decay_lr_rate`, it decays as
    min_lr / (1 + decay_lr_rate x decay steps / decay_step_size). With `cycle_momentum`, an
    optimizer with `betas` cycles beta1 the opposite way (cycle_max_mom -> cycle_min_mom -> max)."""

    def __init__(self, optimizer: torch.optim.Optimizer, cycle_min_lr: float | Sequence[float],
                 cycle_max_lr: float | Sequence[float], decay_lr_rate: float = 0.0,
                 cycle_first_step_size: int = 2000, cycle_second_step_size: int | None = None,
                 cycle_first_stair_count: int = 0, cycle_second_stair_count: int | None = None,
                 decay_step_size: int = 0, cycle_momentum: bool = True, cycle_min_mom: float = 0.8,
                 cycle_max_mom: float = 0.9, decay_mom_rate: float = 0.0, last_batch_iteration: int = -1):
        super().__init__(optimizer, last_batch_iteration)
        first = float(cycle_first_step_size)
        second = float(cycle_second_step_size) if cycle_second_step_size is not None else first
        if first <= 0:
            raise ValueError(f"cycle_first_step_size must be positive, got {cycle_first_step_size}")
        if second < 0:
            raise ValueError(f"cycle_second_step_size must be non-negative, got {cycle_second_step_size}")
        self.first_step_size, self.second_step_size = first, second
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = cycle_first_stair_count if cycle_second_stair_count is None \
            else cycle_second_stair_count
        self.decay_step_size = decay_step_size
        self.min_lrs = per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        self.decay_lr_rate = decay_lr_rate
        self.skip_lr_decay = math.isclose(decay_step_size, 0) or math.isclose(decay_lr_rate, 0)
        self.skip_mom_decay = math.isclose(decay_step_size, 0) or math.isclose(decay_mom_rate, 0)
        self.decay_mom_rate = decay_mom_rate
        if last_batch_iteration == -1:
            for group, lr in zip(optimizer.param_groups, self.min_lrs):
                set_lr(group, lr)
        # DeepSpeed cycles momentum only for optimizers whose defaults have betas (it warns otherwise)
        self.cycle_momentum = cycle_momentum and "betas" in optimizer.defaults
        if self.cycle_momentum:
            self.min_moms = [(mom, 0.99) for mom in per_group(optimizer, cycle_min_mom, "cycle_min_mom")]
            self.max_moms = [(mom, 0.99) for mom in per_group(optimizer, cycle_max_mom, "cycle_max_mom")]
            if last_batch_iteration == -1:
                for group, betas in zip(optimizer.param_groups, self.min_moms):
                    group["betas"] = betas

    def _scale_factor(self) -> float:
        iteration = self.last_batch_iteration + 1
        cycle = math.floor(1 + iteration / self.total_size)
        x = 1.0 + iteration / self.total_size - cycle
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:  # from the integer position, so a stair's edge is never lost to rounding
            in_cycle = iteration % self.total_size
            if in_cycle <= self.first_step_size:
                position = in_cycle * stairs / self.first_step_size
            else:
                position = (self.total_size - in_cycle) * stairs / self.second_step_size
            scale = math.floor(position) / stairs
        return scale

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < self.total_size:
            scale = self._scale_factor()
            return [low + (high - low) * scale for low, high in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        factor = 1 + self.decay_lr_rate * ((self.last_batch_iteration - self.total_size + 1) / self.decay_step_size)
        return [low / factor for low in self.min_lrs]

    def get_mom(self) -> list[tuple[float, float]]:
        if self.last_batch_iteration < self.total_size:
            scale = self._scale_factor()
            return [(high[0] - (high[0] - low[0]) * scale, low[1]) for low, high in zip(self.min_moms, self.max_moms)]
        if self.skip_mom_decay:
            return list(self.max_moms)
        factor = 1 + self.decay_mom_rate * ((self.last_batch_iteration - self.total_size + 1) / self.decay_step_size)
        return [(beta1 * factor, beta2) for beta1, beta2 in self.max_moms]

    def _write(self) -> None:
        super()._write()
        if self.cycle_momentum:
            for group, betas in zip(self.optimizer.param_groups, self.get_mom()):
                group["betas"] = betas


SCHEDULERS = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR,
              "OneCycle": OneCycle, "LRRangeTest": LRRangeTest}
