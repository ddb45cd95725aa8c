"""shardwise's configuration: DeepSpeed's JSON format, validated and resolved in one pass."""

from shardwise.config.defaults_table import default_config_table
from shardwise.config.errors import ConfigError
from shardwise.config.loader import load_config, read_config
from shardwise.config.resolve import fill_auto
from shardwise.config.schema import (
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
