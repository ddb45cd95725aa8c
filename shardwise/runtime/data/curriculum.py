"""Curriculum learning's difficulty schedule (DeepSpeed's data efficiency library,
`data_efficiency.data_sampling.curriculum_learning.curriculum_metrics.<metric>`).

A run starts on easy samples (short sequences, a low value of an offline metric) and
raises the difficulty with the step until `max_difficulty`. The schedules DeepSpeed 0.19.8
computes (deepspeed/runtime/data_pipeline/curriculum_scheduler.py), at global step s:

    fixed_discrete  difficulty[i] for the first i with s <= max_step[i]; past the last
                    max_step, the last difficulty (one more difficulty than max_steps);
    fixed_root      d = floor((s / total_curriculum_step)^(1/root_degree) · (max − min) + min),
                    rounded down to a multiple of difficulty_step, raised to the first
                    multiple of difficulty_step at or above min, capped at max;
    fixed_linear    fixed_root with root_degree 1;
    custom          a function of the step the caller sets.

The difficulty only rises: once it reaches `max_difficulty` it is no longer recomputed,
and `update_difficulty` keeps the current value there (DeepSpeed's behaviour, which a
custom schedule that falls again would notice).
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable

log = logging.getLogger("shardwise")

SCHEDULES = ("fixed_discrete", "fixed_root", "fixed_linear", "custom")


class CurriculumScheduler:
    """One metric's schedule, with DeepSpeed's interface: built from the metric's config
    block; `state` holds min/max/current difficulty, the schedule type and its config (what
    a checkpoint keeps)."""

    def __init__(self, config: dict[str, Any]):
        for key in ("min_difficulty", "max_difficulty", "schedule_type"):
            if key not in config:
                raise ValueError(f"curriculum learning needs {key!r} in each metric's block (got keys "
                                 f"{sorted(config)})")
        kind = config["schedule_type"]
        if kind not in SCHEDULES:
            raise ValueError(f"curriculum schedule_type {kind!r} is not one of {', '.join(SCHEDULES)}")
        self.state: dict[str, Any] = {
            "min_difficulty": config["min_difficulty"],
            "max_difficulty": config["max_difficulty"],
            "current_difficulty": config["min_difficulty"],
            "schedule_type": kind,
        }
        self.custom_get_difficulty: Callable[[int], Any] | None = None
        if kind != "custom":
            self.state["schedule_config"] = _checked_schedule(kind, config.get("schedule_config"))

    def set_custom_get_difficulty(self, schedule_function: Callable[[int], Any]) -> None:
        self.custom_get_difficulty = schedule_function

    def get_difficulty(self, global_steps: int) -> Any:
        kind = self.state["schedule_type"]
        if kind == "fixed_discrete":
            return self._discrete(global_steps)
        if kind == "fixed_linear":
            return self._root(global_steps, 1)
        if kind == "fixed_root":
            return self._root(global_steps, self.state["schedule_config"]["root_degree"])
        if self.custom_get_difficulty is None:
            raise RuntimeError("curriculum schedule_type 'custom' needs its function: call "
                               "engine.set_custom_curriculum_learning_schedule({metric: fn}) first")
        return self.custom_get_difficulty(global_steps)

    def update_difficulty(self, global_steps: int) -> Any:
        if self.state["current_difficulty"] < self.state["max_difficulty"]:
            self.state["current_difficulty"] = self.get_difficulty(global_steps)
        return self.state["current_difficulty"]

    def _discrete(self, step: int) -> Any:
        schedule = self.state["schedule_config"]
        for limit, difficulty in zip(schedule["max_step"], schedule["difficulty"]):
            if step <= limit:
                return difficulty
        return schedule["difficulty"][-1]

    def _root(self, step: int, degree: float) -> int:
        schedule = self.state["schedule_config"]
        low, high, quantum = self.state["min_difficulty"], self.state["max_difficulty"], schedule["difficulty_step"]
        fraction = (float(step) / schedule["total_curriculum_step"]) ** (1.0 / degree)
        difficulty = math.floor(fraction * (high - low) + low)
        difficulty -= difficulty % quantum
        first = -(-low // quantum) * quantum  # the first multiple of the quantum at or above min
        return min(max(difficulty, first), high)


def _checked_schedule(kind: str, schedule: dict | None) -> dict:
    """The schedule's own block, with the keys its type needs (DeepSpeed asserts them)."""
    needed = {"fixed_discrete": ("difficulty", "max_step"),
              "fixed_root": ("total_curriculum_step", "difficulty_step", "root_degree"),
              "fixed_linear": ("total_curriculum_step", "difficulty_step")}[kind]
    if not isinstance(schedule, dict) or any(key not in schedule for key in needed):
        raise ValueError(f"curriculum schedule_type {kind!r} needs schedule_config with {', '.join(needed)}; got "
                         f"{schedule!r}")
    if kind == "fixed_discrete":
        difficulties, limits = schedule["difficulty"], schedule["max_step"]
        if not limits or len(difficulties) != len(limits) + 1:
            raise ValueError(f"fixed_discrete needs one more difficulty than max_step (the last holds after the "
                             f"last max_step); got {len(difficulties)} difficulties and {len(limits)} max_steps")
    elif schedule["difficulty_step"] % 8:
        log.warning("shardwise: curriculum difficulty_step %s is not a multiple of 8: with the seqlen metric, "
                    "sequence lengths that are multiples of 8 (16 for int8) run on tensor cores",
                    schedule["difficulty_step"])
    return schedule
