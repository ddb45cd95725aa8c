"""`deepspeed.runtime.fp16.loss_scaler`: DeepSpeed's loss-scaler classes with its
constructors and attributes (`cur_scale`, `cur_iter`, `last_overflow_iter`,
`cur_hysteresis`, `loss_scale`, `update_scale(overflow)`, `backward(loss)`).

Scripts import them for two things: `torch.serialization.add_safe_globals([ZeroStageEnum,
LossScaler])` before reading DeepSpeed checkpoints with `weights_only=True`, and fp16 loops
written around a scaler of their own. The dynamic schedule is the engine's own
(runtime/precision/loss_scaler.py, equal to DeepSpeed 0.19.8's step for step), kept here
under DeepSpeed's names; what this file adds is DeepSpeed's refusal to go below the
minimum scale (`raise_error_at_min_scale`).

The classes carry DeepSpeed's module path (`deepspeed.runtime.fp16.loss_scaler`, what
`import deepspeed` finds in a `shardwise run --as-deepspeed` run) and pickle as DeepSpeed's
do, attributes only: a checkpoint DeepSpeed wrote loads into them once they are
allow-listed, and theirs loads into DeepSpeed.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from shardwise.runtime.precision.loss_scaler import LossScaler as ScaleSchedule

SCALE_FACTOR = 2.0  # DeepSpeed's: the scale halves on an overflow and doubles after a window
DEEPSPEED_MODULE = "deepspeed.runtime.fp16.loss_scaler"


class LossScalerBase:
    """A scale the loss is multiplied by before backward (`cur_scale`)."""

    __module__ = DEEPSPEED_MODULE
    dynamic = False

    def __init__(self, cur_scale: float):
        self.cur_scale = cur_scale

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def scale_gradient(self, module: Any, grad_in: tuple, grad_out: tuple) -> tuple:
        return tuple(self.loss_scale * grad for grad in grad_in)

    def update_scale(self, overflow: bool) -> None:
        """A static scale stays as it is."""

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.loss_scale

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        self.scale_loss(loss).backward(retain_graph=retain_graph)


class LossScaler(LossScalerBase):
    """A static scale."""

    __module__ = DEEPSPEED_MODULE

    def __init__(self, scale: float = 1):
        super().__init__(scale)

    def has_overflow(self, params: Iterable[torch.Tensor]) -> bool:
        return False


class DynamicLossScaler(LossScalerBase):
    """DeepSpeed's dynamic scale: halved on an overflow once `delayed_shift` overflows are
    used up (never below `min_scale`; at it, an error when `raise_error_at_min_scale`),
    doubled after `scale_window` clean steps."""

    __module__ = DEEPSPEED_MODULE
    dynamic = True
    scale_factor = SCALE_FACTOR

    def __init__(self, init_scale: float, scale_window: int, min_scale: float, delayed_shift: int,
                 consecutive_hysteresis: bool, raise_error_at_min_scale: bool = True, dtype: torch.dtype = torch.half):
        self._schedule = ScaleSchedule(init_scale, dynamic=True, scale_window=scale_window, hysteresis=delayed_shift,
                                       consecutive_hysteresis=consecutive_hysteresis, min_scale=min_scale)
        self.scale_window = scale_window
        self.min_scale = min_scale
        self.delayed_shift = delayed_shift
        self.consecutive_hysteresis = consecutive_hysteresis
        self.raise_error_at_min_scale = raise_error_at_min_scale
        self.dtype = dtype

    @property
    def cur_scale(self) -> float:
        return self._schedule.scale

    @property
    def cur_iter(self) -> int:
        return self._schedule.iteration

    @property
    def last_overflow_iter(self) -> int:
        return self._schedule.last_overflow_iteration

    @property
    def cur_hysteresis(self) -> int:
        return self._schedule.remaining_hysteresis

    def __getstate__(self) -> dict[str, Any]:
        """DeepSpeed's attributes, as its DynamicLossScaler pickles."""
        return {"cur_scale": self.cur_scale, "dynamic": True, "cur_iter": self.cur_iter,
                "last_overflow_iter": self.last_overflow_iter, "scale_factor": self.scale_factor,
                "scale_window": self.scale_window, "min_scale": self.min_scale, "delayed_shift": self.delayed_shift,
                "cur_hysteresis": self.cur_hysteresis, "consecutive_hysteresis": self.consecutive_hysteresis,
                "raise_error_at_min_scale": self.raise_error_at_min_scale, "dtype": self.dtype}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """From DeepSpeed's attributes (a DeepSpeed checkpoint's scaler, or one of these)."""
        if state.get("scale_factor", SCALE_FACTOR) != SCALE_FACTOR:
            raise ValueError(f"a loss scaler with scale_factor {state['scale_factor']}: the scale is halved and "
                             f"doubled by {SCALE_FACTOR} here, as DeepSpeed's scalers are built")
        self.__init__(state["cur_scale"], state["scale_window"], state["min_scale"], state["delayed_shift"],
                      state["consecutive_hysteresis"], state.get("raise_error_at_min_scale", True),
                      state.get("dtype", torch.half))
        self._schedule.iteration = state["cur_iter"]
        self._schedule.last_overflow_iteration = state["last_overflow_iter"]
        self._schedule.remaining_hysteresis = state["cur_hysteresis"]

    def has_overflow_serial(self, params: Iterable[torch.Tensor]) -> bool:
        return any(param.grad is not None and not torch.isfinite(param.grad).all() for param in params)

    def update_scale(self, overflow: bool) -> None:
        lowering = self.delayed_shift == 1 or self.cur_hysteresis == 1
        if overflow and lowering and self.cur_scale == self.min_scale and self.raise_error_at_min_scale:
            raise Exception("Current loss scale already at minimum - cannot decrease scale anymore. Exiting run.")
        self._schedule.update(overflow)


def CreateLossScaler(dtype: torch.dtype, static_loss_scale: float, dynamic_scaling: bool,  # noqa: N802 (DeepSpeed's name)
                     dynamic_loss_args: dict[str, Any] | None) -> LossScalerBase:
    """DeepSpeed's factory: the dynamic scaler for fp16 with `dynamic_scaling`, else a static
    one (scale 1 for other dtypes)."""
    if dtype == torch.half and dynamic_scaling:
        if dynamic_loss_args is None:
            raise ValueError("dynamic loss scaling needs dynamic_loss_args (init_scale, scale_window, min_scale, "
                             "delayed_shift, consecutive_hysteresis)")
        return DynamicLossScaler(dtype=dtype, **dynamic_loss_args)
    return LossScaler(scale=static_loss_scale if dtype == torch.half else 1.0)
