"""`deepspeed.runtime.config`: the parsed config some scripts read (`DeepSpeedConfig`), the
config error scripts catch, and the optimizer-type names DeepSpeed's config accepts
(lower-cased, as DeepSpeed compares them).

`DeepSpeedConfigError` is shardwise's own config error (frontends/deepspeed/config/errors.py):
every config problem `deepspeed.initialize` finds is raised as it, listing each problem
with its key, so `except deepspeed.DeepSpeedConfigError` catches what it catches under
DeepSpeed (and DeepSpeed's other config exceptions, which shardwise reports the same way).
"""

import copy
import math
import os
from typing import Any

import torch.distributed as dist

from shardwise.frontends.deepspeed.config import load_config, read_config
from shardwise.frontends.deepspeed.config.deepspeed_keys import DATA_TYPE_NAMES
from shardwise.frontends.deepspeed.config.errors import ConfigError as DeepSpeedConfigError
from shardwise.frontends.deepspeed.config.policies import DTYPES
from shardwise.frontends.deepspeed.config.written import (DEEPSPEED_OPTIMIZERS, written_optimizer_name,
                                                           written_value)

__all__ = ["ADAGRAD_OPTIMIZER", "ADAMW_OPTIMIZER", "ADAM_OPTIMIZER", "ADAM_W_MODE", "DEEPSPEED_OPTIMIZERS",
           "DeepSpeedConfig", "DeepSpeedConfigError", "LAMB_OPTIMIZER", "LION_OPTIMIZER", "ONEBIT_ADAM_OPTIMIZER",
           "ONEBIT_LAMB_OPTIMIZER", "TORCH_ADAM_PARAM", "ZERO_ONE_ADAM_OPTIMIZER", "load_ds_config"]

ADAGRAD_OPTIMIZER = "adagrad"
ADAM_OPTIMIZER = "adam"
ADAMW_OPTIMIZER = "adamw"
LAMB_OPTIMIZER = "lamb"
LION_OPTIMIZER = "lion"
ONEBIT_ADAM_OPTIMIZER = "onebitadam"
ZERO_ONE_ADAM_OPTIMIZER = "zerooneadam"
ONEBIT_LAMB_OPTIMIZER = "onebitlamb"

# DeepSpeed 0.19.8 clips at a norm of 1.0 when a config names no `gradient_clipping`
# (its runtime/constants.py GRADIENT_CLIPPING_DEFAULT); shardwise's own configs default to none.
DEEPSPEED_GRADIENT_CLIPPING = 1.0

TORCH_ADAM_PARAM = "torch_adam"  # optimizer.params key: torch's Adam instead of DeepSpeed's kernel
ADAM_W_MODE = "adam_w_mode"  # optimizer.params key: decoupled weight decay (True unless switched off)


def load_ds_config(config: dict[str, Any] | str | os.PathLike) -> dict[str, Any]:
    """DeepSpeed's `deepspeed.load_ds_config`: a dict as it is, else the JSON file it names or
    the base64-encoded config it is."""
    return config if isinstance(config, dict) else read_config(config)


class DeepSpeedConfig:
    """DeepSpeed's parsed config, for scripts that read their config through it before (or
    instead of) `deepspeed.initialize`: `DeepSpeedConfig(path_or_dict, mpu=None)`. The config
    is checked as `initialize` checks it (a `DeepSpeedConfigError` listing every problem)
    and the batch sizes resolved for the data-parallel size: the process group's world size
    when one is initialized (an `mpu`'s data-parallel size where given), else 1, as in
    DeepSpeed.

    The attributes are DeepSpeed 0.19.8's for the batch, precision, ZeRO, optimizer,
    scheduler and the settings scripts test (`_param_dict` is the config as written;
    `zero_config`, `float16_config`, `bfloat16_config`, `flops_profiler_config` and
    `activation_checkpointing_config` are shardwise's blocks, under DeepSpeed's field names).
    Any other attribute is an AttributeError naming those provided. A `mesh_device`
    (DeepSpeed's device mesh) is refused: the sizes come from the process group or an mpu."""

    def __init__(self, config: dict[str, Any] | str | os.PathLike, mpu: Any = None, mesh_device: Any = None):
        if mesh_device is not None:
            raise ValueError("DeepSpeedConfig(mesh_device=...) is not supported: the data-parallel size comes from "
                             "the process group, or pass mpu=; set sequence_parallel_size in the config")
        self._param_dict = read_config(config)
        self.global_rank = dist.get_rank() if dist.is_initialized() else 0
        if mpu is not None:
            self.world_size = mpu.get_data_parallel_world_size()
        else:
            self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        raw = copy.deepcopy(self._param_dict)
        raw.setdefault("gradient_clipping", DEEPSPEED_GRADIENT_CLIPPING)  # DeepSpeed's default, as initialize's
        # load_config divides the processes by the config's model-parallel sizes; an mpu gives the quotient
        processes = self.world_size if mpu is None else self.world_size * _model_parallel_size(raw)
        resolved = load_config(raw, world_size=processes)
        written = self._param_dict
        self.train_batch_size = resolved.train_batch_size
        self.train_micro_batch_size_per_gpu = resolved.train_micro_batch_size_per_gpu
        self.gradient_accumulation_steps = resolved.gradient_accumulation_steps
        self.steps_per_print = written_value(written, "steps_per_print", None)
        self.gradient_clipping = resolved.gradient_clipping
        self.dataloader_drop_last = resolved.dataloader_drop_last
        self.zero_config = resolved.zero_optimization
        self.zero_optimization_stage = resolved.zero_optimization.stage
        self.zero_enabled = self.zero_optimization_stage > 0
        self.float16_config = resolved.fp16
        self.bfloat16_config = resolved.bf16
        self.flops_profiler_config = resolved.flops_profiler
        self.activation_checkpointing_config = resolved.activation_checkpointing
        self.optimizer_name = written_optimizer_name(written)
        self.optimizer_params = written_value(written, "optimizer.params", None) if self.optimizer_name else None
        self.scheduler_name = written_value(written, "scheduler.type", None)
        self.scheduler_params = written_value(written, "scheduler.params", None) if self.scheduler_name else None
        communication = written_value(written, "communication_data_type", None)
        self.communication_data_type = DTYPES[communication.lower()] if communication is not None else None
        self.zero_allow_untested_optimizer = written_value(written, "zero_allow_untested_optimizer", False)
        self.zero_force_ds_cpu_optimizer = written_value(written, "zero_force_ds_cpu_optimizer", True)
        self.prescale_gradients = written_value(written, "prescale_gradients", False)
        self.gradient_predivide_factor = written_value(written, "gradient_predivide_factor", 1.0)
        self.gradient_allreduce_op = resolved.gradient_allreduce_op
        self.wall_clock_breakdown = (written_value(written, "wall_clock_breakdown", False)
                                     or resolved.flops_profiler.enabled)
        self.memory_breakdown = written_value(written, "memory_breakdown", False)
        self.dump_state = written_value(written, "dump_state", False)
        self.load_universal_checkpoint = written_value(written, "checkpoint.load_universal", False)
        self.use_node_local_storage = written_value(written, "checkpoint.use_node_local_storage", False)
        self.torch_autocast_enabled = resolved.torch_autocast.enabled
        autocast = resolved.torch_autocast.dtype
        self.torch_autocast_dtype = DTYPES[DATA_TYPE_NAMES[autocast]] if autocast is not None else None
        self.data_efficiency_enabled = resolved.data_efficiency.enabled
        self.checkpoint_tag_validation_enabled = resolved.checkpoint.tag_validation != "IGNORE"
        self.checkpoint_tag_validation_fail = resolved.checkpoint.tag_validation == "FAIL"

    def __getattr__(self, name: str) -> Any:
        provided = ", ".join(sorted(key for key in vars(self) if not key.startswith("__")))
        raise AttributeError(f"DeepSpeedConfig has no attribute {name!r} in shardwise's compatibility package "
                             f"(provided: {provided}); read the config's dict, `_param_dict`, for other keys")


def _model_parallel_size(raw: dict[str, Any]) -> int:
    """The model-parallel ranks per data-parallel rank the config's blocks name, so that an
    mpu's data-parallel size times this is the world load_config divides."""
    sizes = (written_value(raw, "tensor_parallel.size", 1), written_value(raw, "sequence_parallel_size", 1),
             written_value(raw, "sequence_parallel.size", 1), written_value(raw, "pipeline_parallel.size", 1))
    return math.prod(int(size) for size in sizes)
