"""`deepspeed.runtime.zero.offload_config`: the offload blocks' models, the device names
(the same objects as in `deepspeed.runtime.zero.config`), and the kinds of state
`engine.offload_states(include=...)` moves."""

from enum import Enum

from shardwise.frontends.deepspeed.api.runtime.zero.config import (
    DeepSpeedZeroOffloadOptimizerConfig,
    DeepSpeedZeroOffloadParamConfig,
    OffloadDeviceEnum,
)

__all__ = ["DeepSpeedZeroOffloadOptimizerConfig", "DeepSpeedZeroOffloadParamConfig", "OffloadDeviceEnum",
           "OffloadStateTypeEnum"]


class OffloadStateTypeEnum(str, Enum):
    """DeepSpeed's names of the states `offload_states` moves; their values are those of
    shardwise's `StateKind` (runtime/zero/parked_states.py), which the engine takes."""

    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"
