"""`deepspeed.zero`: DeepSpeed's ZeRO-3 names for user code, which DeepSpeed defines in
`deepspeed.runtime.zero.partition_parameters` (see there for what each does here)."""

from shardwise.frontends.deepspeed.api.runtime.zero.partition_parameters import (
    GatheredParameters,
    Init,
    ZeroParamStatus,
    ZeroParamType,
    register_external_parameter,
    unregister_external_parameter,
)

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "ZeroParamType", "register_external_parameter",
           "unregister_external_parameter"]
