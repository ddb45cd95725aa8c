"""DeepSpeed's Python API on shardwise (C26): `import shardwise.frontends.deepspeed.api as deepspeed`,
or run an unmodified script with `shardwise run --as-deepspeed`, which makes this
package importable as `deepspeed` (and `deepspeed.X` as `shardwise.frontends.deepspeed.api.X`)
for that run only.

    engine, optimizer, loader, scheduler = deepspeed.initialize(args=args, model=model,
                                                                model_parameters=model.parameters(),
                                                                training_data=dataset)

The engine is shardwise's (`Engine`, an nn.Module passing unknown attributes to the
model) with DeepSpeed's method shapes (runtime/engine/deepspeed_engine.py; a PipelineModule's
is its `PipelineEngine`, runtime/pipe/engine.py). What each argument of `initialize` does
is in init_engine.py; what `zero.Init` does and does not do, in zero.py.
"""

from shardwise.frontends.deepspeed.api import (
    accelerator,
    checkpoint,
    checkpointing,
    comm,
    compression,
    git_version_info,
    inference,
    launcher,
    moe,
    ops,
    pipe,
    runtime,
    utils,
    zero,
)
from shardwise.frontends.deepspeed.api.accelerator import get_accelerator
from shardwise.frontends.deepspeed.api.arguments import add_config_arguments
from shardwise.frontends.deepspeed.api.autotp import set_autotp_mode, tp_model_init
from shardwise.frontends.deepspeed.api.comm import DEFAULT_PORT as TORCH_DISTRIBUTED_DEFAULT_PORT, init_distributed
from shardwise.frontends.deepspeed.api.runtime.engine import DeepSpeedEngine
from shardwise.frontends.deepspeed.api.inference import InferenceEngine, init_inference
from shardwise.frontends.deepspeed.api.init_engine import initialize
from shardwise.frontends.deepspeed.api.runtime.config import DeepSpeedConfig, DeepSpeedConfigError, load_ds_config
from shardwise.frontends.deepspeed.api.runtime.pipe.engine import PipelineEngine
from shardwise.frontends.deepspeed.api.pipe import PipelineModule
from shardwise.frontends.deepspeed.api.runtime.base_optimizer import DeepSpeedOptimizer
from shardwise.frontends.deepspeed.api.runtime.dataloader import DeepSpeedDataLoader
from shardwise.frontends.deepspeed.api.utils import OnDevice, log_dist, logger

__version__ = git_version_info.version  # the DeepSpeed release whose API this package follows
version, git_hash, git_branch = git_version_info.version, git_version_info.git_hash, git_version_info.git_branch

__all__ = [
    "DeepSpeedConfig",
    "DeepSpeedConfigError",
    "DeepSpeedDataLoader",
    "DeepSpeedEngine",
    "DeepSpeedOptimizer",
    "InferenceEngine",
    "OnDevice",
    "PipelineEngine",
    "PipelineModule",
    "TORCH_DISTRIBUTED_DEFAULT_PORT",
    "accelerator",
    "add_config_arguments",
    "checkpoint",
    "checkpointing",
    "comm",
    "compression",
    "get_accelerator",
    "git_branch",
    "git_hash",
    "git_version_info",
    "inference",
    "init_distributed",
    "init_inference",
    "initialize",
    "launcher",
    "load_ds_config",
    "log_dist",
    "logger",
    "moe",
    "ops",
    "pipe",
    "runtime",
    "set_autotp_mode",
    "tp_model_init",
    "utils",
    "version",
    "zero",
]
