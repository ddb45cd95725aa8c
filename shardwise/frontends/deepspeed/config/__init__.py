"""shardwise's configuration: DeepSpeed's JSON format, validated and resolved in one pass."""

from shardwise.frontends.deepspeed.config.defaults_table import default_config_table
from shardwise.frontends.deepspeed.config.errors import ConfigError
from shardwise.frontends.deepspeed.config.loader import load_config, read_config
from shardwise.frontends.deepspeed.config.resolve import fill_auto
from shardwise.frontends.deepspeed.config.schema import (
    ActivationCheckpointingConfig,
    AioConfig,
    Bf16Config,
    Fp16Config,
    OffloadConfig,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    OptimizerConfig,
    PipelineParallelConfig,
    SchedulerConfig,
    SequenceParallelConfig,
    ShardwiseConfig,
    TensorBoardConfig,
    TensorParallelConfig,
    ZeroConfig,
)

__all__ = [
    "ActivationCheckpointingConfig",
    "AioConfig",
    "Bf16Config",
    "ConfigError",
    "Fp16Config",
    "OffloadConfig",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OptimizerConfig",
    "PipelineParallelConfig",
    "SchedulerConfig",
    "SequenceParallelConfig",
    "ShardwiseConfig",
    "TensorBoardConfig",
    "TensorParallelConfig",
    "ZeroConfig",
    "default_config_table",
    "fill_auto",
    "load_config",
    "read_config",
]
