"""`deepspeed.zero`: DeepSpeed's ZeRO names for user code: ZeRO-3's, which DeepSpeed defines
in `deepspeed.runtime.zero.partition_parameters` (see there for what each does here), the
tiled linear layers (`runtime.zero.tiling`) and `unwrap_model_for_generation`
(`runtime.zero.generation`)."""

from shardwise.frontends.deepspeed.api.runtime.zero.generation import unwrap_model_for_generation
from shardwise.frontends.deepspeed.api.runtime.zero.partition_parameters import (
    GatheredParameters,
    Init,
    ZeroParamStatus,
    ZeroParamType,
    register_external_parameter,
    unregister_external_parameter,
)
from shardwise.frontends.deepspeed.api.runtime.zero.tiling import TiledLinear, TiledLinearReturnBias

__all__ = ["GatheredParameters", "Init", "TiledLinear", "TiledLinearReturnBias", "ZeroParamStatus", "ZeroParamType",
           "register_external_parameter", "unregister_external_parameter", "unwrap_model_for_generation"]
