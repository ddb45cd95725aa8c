"""`deepspeed.runtime.zero.config`: the ZeRO block's model and the stage names.

`DeepSpeedZeroConfig` is shardwise's resolved `zero_optimization` block (the config's
schema, frontends/deepspeed/config/schema.py), under DeepSpeed's name: DeepSpeed's JSON
keys and defaults. DeepSpeed's own pydantic model also answers to internal aliases
(`prefetch_bucket_size` for `stage3_prefetch_bucket_size`, and long-deprecated keys such as
`cpu_offload`); shardwise's does not, and build configs through `deepspeed.initialize`.
"""

from __future__ import annotations

from enum import Enum, IntEnum

from shardwise.frontends.deepspeed.config.schema import OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig

__all__ = ["DeepSpeedZeroConfig", "DeepSpeedZeroOffloadOptimizerConfig", "DeepSpeedZeroOffloadParamConfig",
           "OffloadDeviceEnum", "ZeroStageEnum"]

DeepSpeedZeroConfig = ZeroConfig
DeepSpeedZeroOffloadOptimizerConfig = OffloadOptimizerConfig
DeepSpeedZeroOffloadParamConfig = OffloadParamConfig


class ZeroStageEnum(IntEnum):
    """What each stage partitions (DeepSpeed's names). Under DeepSpeed's module path, as the
    loss scalers (runtime/fp16/loss_scaler.py): scripts allow-list both to read DeepSpeed's
    checkpoints with `torch.load(weights_only=True)`, which pickle them by that path."""

    __module__ = "deepspeed.runtime.zero.config"

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


class OffloadDeviceEnum(str, Enum):
    """Where `offload_optimizer` / `offload_param` put a partition."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"
