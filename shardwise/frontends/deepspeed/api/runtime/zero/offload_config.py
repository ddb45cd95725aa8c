"""`deepspeed.runtime.zero.offload_config`: the offload blocks' models and the device
names, where DeepSpeed keeps them (the same objects as in `deepspeed.runtime.zero.config`)."""

from shardwise.frontends.deepspeed.api.runtime.zero.config import (
    DeepSpeedZeroOffloadOptimizerConfig,
    DeepSpeedZeroOffloadParamConfig,
    OffloadDeviceEnum,
)

__all__ = ["DeepSpeedZeroOffloadOptimizerConfig", "DeepSpeedZeroOffloadParamConfig", "OffloadDeviceEnum"]
