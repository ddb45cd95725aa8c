"""Loss scaling for fp16 (C5): keep small gradients representable, skip steps that overflow.

The dynamic rule is DeepSpeed's: start at 2**initial_scale_power; on an overflow skip the
step and halve the scale (after `hysteresis` tolerated overflows, never below
`min_loss_scale`); double it on the clean step that follows a multiple of
`loss_scale_window` clean steps (DeepSpeed 0.19.8 counts the steps strictly between the
last overflow and this one, so with window W the first doubling comes on clean step W + 1
and then every W steps; tests/runtime/precision/test_loss_scaler.py holds its sequences). Overflow is decided
on the global gradient norm, which every rank already all-reduces for clipping, so ranks
agree on skipping without an extra collective.
"""

from __future__ import annotations

from typing import Any

from shardwise.runtime.precision.policy import LossScalingPolicy


class LossScaler:
    """Static scale (`dynamic=False`) or DeepSpeed's dynamic schedule."""

    def __init__(
        self,
        scale: float = 1.0,
        dynamic: bool = False,
        scale_window: int = 1000,
        hysteresis: int = 2,
        consecutive_hysteresis: bool = False,
        min_scale: float = 1.0,
    ):
        self.scale = float(scale)
        self.dynamic = dynamic
        self.scale_window = scale_window
        self.hysteresis = hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis
        self.min_scale = min_scale
        self.remaining_hysteresis = hysteresis
        self.iteration = 0
        self.last_overflow_iteration = -1

    @classmethod
    def from_policy(cls, policy: LossScalingPolicy | None) -> "LossScaler":
        """Scale 1 without loss scaling (fp32, bf16)."""
        if policy is None:
            return cls(1.0)
        return cls(policy.initial_scale, dynamic=policy.dynamic, scale_window=policy.window,
                   hysteresis=policy.hysteresis, consecutive_hysteresis=policy.consecutive_hysteresis,
                   min_scale=policy.min_scale)

    @property
    def can_absorb_overflow(self) -> bool:
        """An overflow now is part of finding the scale (it will be lowered), not a sign
        that training went wrong."""
        return self.dynamic and self.scale > self.min_scale

    def update(self, overflow: bool) -> None:
        """Record the outcome of one optimizer step (called on every boundary)."""
        if self.dynamic:
            if overflow:
                if self.hysteresis == 1 or self.remaining_hysteresis == 1:
                    self.scale = max(self.scale / 2, self.min_scale)
                else:
                    self.remaining_hysteresis -= 1
                self.last_overflow_iteration = self.iteration
            else:
                if self.consecutive_hysteresis:
                    self.remaining_hysteresis = self.hysteresis
                stable = self.iteration - self.last_overflow_iteration - 1  # clean steps before this one
                if stable > 0 and stable % self.scale_window == 0:
                    if not self.consecutive_hysteresis:
                        self.remaining_hysteresis = self.hysteresis
                    self.scale *= 2
        self.iteration += 1

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "remaining_hysteresis": self.remaining_hysteresis,
            "iteration": self.iteration,
            "last_overflow_iteration": self.last_overflow_iteration,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.remaining_hysteresis = int(state["remaining_hysteresis"])
        self.iteration = int(state["iteration"])
        self.last_overflow_iteration = int(state["last_overflow_iteration"])
