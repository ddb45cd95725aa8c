"""`deepspeed.runtime.zero`: ZeRO's Python names under DeepSpeed's module paths
(`deepspeed.zero` is the same names: api/zero.py)."""

from shardwise.frontends.deepspeed.api.runtime.zero import config, partition_parameters, utils
from shardwise.frontends.deepspeed.api.runtime.zero.generation import unwrap_model_for_generation
from shardwise.frontends.deepspeed.api.runtime.zero.partition_parameters import (
    GatheredParameters,
    Init,
    ZeroParamStatus,
    ZeroParamType,
    register_external_parameter,
)

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "ZeroParamType", "config", "partition_parameters",
           "register_external_parameter", "unwrap_model_for_generation", "utils"]
