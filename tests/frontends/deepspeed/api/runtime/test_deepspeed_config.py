"""`deepspeed.DeepSpeedConfig(config, mpu=None)`: the parsed config scripts read before
`initialize` answers what DeepSpeed 0.19.8's does (the expected values below are
DeepSpeed's own, on CPU without a process group; with DEEPSPEED_PYTHON set the slow test
asks DeepSpeed again), checks the config as `initialize` does, and sizes the batch for an
mpu's data-parallel ranks."""

from __future__ import annotations

import inspect
import json
import os

import pytest
import torch

import shardwise.frontends.deepspeed.api as deepspeed
from tests.frontends.deepspeed.deepspeed_side import deepspeed_json

CONFIG = {"train_batch_size": 8, "gradient_accumulation_steps": 2, "steps_per_print": 7,
          "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}, "bf16": {"enabled": True},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "communication_data_type": "fp32",
          "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3}},
          "checkpoint": {"tag_validation": "FAIL"}}

NAMES = ["train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "steps_per_print",
         "gradient_clipping", "dataloader_drop_last", "zero_optimization_stage", "zero_enabled", "optimizer_name",
         "optimizer_params", "scheduler_name", "scheduler_params", "communication_data_type",
         "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "prescale_gradients",
         "gradient_predivide_factor", "gradient_allreduce_op", "wall_clock_breakdown", "memory_breakdown", "dump_state",
         "load_universal_checkpoint", "use_node_local_storage", "torch_autocast_enabled", "torch_autocast_dtype",
         "data_efficiency_enabled", "checkpoint_tag_validation_enabled", "checkpoint_tag_validation_fail",
         "world_size", "global_rank", "_param_dict", "zero_config.stage", "zero_config.offload_optimizer.device",
         "zero_config.reduce_bucket_size", "bfloat16_config.enabled", "float16_config.enabled",
         "float16_config.loss_scale", "flops_profiler_config.enabled",
         "activation_checkpointing_config.partition_activations"]

# DeepSpeed 0.19.8's answers for CONFIG
EXPECTED = {
    "train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
    "steps_per_print": 7, "gradient_clipping": 1.0, "dataloader_drop_last": False, "zero_optimization_stage": 2,
    "zero_enabled": True, "optimizer_name": "adamw", "optimizer_params": {"lr": 0.0001},
    "scheduler_name": "WarmupLR", "scheduler_params": {"warmup_num_steps": 3},
    "communication_data_type": "torch.float32", "zero_allow_untested_optimizer": False,
    "zero_force_ds_cpu_optimizer": True, "prescale_gradients": False, "gradient_predivide_factor": 1.0,
    "gradient_allreduce_op": "mean", "wall_clock_breakdown": False, "memory_breakdown": False, "dump_state": False,
    "load_universal_checkpoint": False, "use_node_local_storage": False, "torch_autocast_enabled": False,
    "torch_autocast_dtype": None, "data_efficiency_enabled": False, "checkpoint_tag_validation_enabled": True,
    "checkpoint_tag_validation_fail": True, "world_size": 1, "global_rank": 0, "_param_dict": CONFIG,
    "zero_config.stage": 2, "zero_config.offload_optimizer.device": "cpu", "zero_config.reduce_bucket_size": 500000000,
    "bfloat16_config.enabled": True, "float16_config.enabled": False, "float16_config.loss_scale": 0.0,
    "flops_profiler_config.enabled": False, "activation_checkpointing_config.partition_activations": False,
}


def _answers(config, names):
    """The attributes as JSON (dtypes by name; "a.b" reads a block's field; DeepSpeed's
    offload device is a str enum). The DeepSpeed script below reads its config with this."""
    row = {}
    for name in names:
        value = config
        for part in name.split("."):
            value = getattr(value, part)
        value = getattr(value, "value", value)
        row[name] = json.loads(json.dumps(value, default=str))
    return row


def test_the_attributes_are_deepspeeds(tmp_path):
    assert _answers(deepspeed.DeepSpeedConfig(CONFIG), NAMES) == EXPECTED
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(CONFIG))
    assert _answers(deepspeed.runtime.config.DeepSpeedConfig(str(path)), NAMES) == EXPECTED


def test_load_ds_config_reads_a_file_or_base64_and_passes_a_dict_through(tmp_path):
    import base64

    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(CONFIG))
    assert deepspeed.load_ds_config(str(path)) == CONFIG
    assert deepspeed.load_ds_config(base64.urlsafe_b64encode(json.dumps(CONFIG).encode()).decode()) == CONFIG
    assert deepspeed.load_ds_config(CONFIG) is CONFIG
    assert deepspeed.TORCH_DISTRIBUTED_DEFAULT_PORT == 29500


class _DataParallelOfTwo:
    """The part of a Megatron mpu DeepSpeedConfig asks."""

    def get_data_parallel_world_size(self) -> int:
        return 2


def test_an_mpu_sizes_the_batch_and_a_bad_config_is_refused_as_initialize_refuses_it():
    config = deepspeed.DeepSpeedConfig(CONFIG, mpu=_DataParallelOfTwo())
    assert (config.world_size, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps) == (2, 2, 2)
    with pytest.raises(deepspeed.DeepSpeedConfigError, match="train_batch_size"):
        deepspeed.DeepSpeedConfig({**CONFIG, "train_micro_batch_size_per_gpu": 3})
    with pytest.raises(AttributeError, match="'hybrid_engine' .*provided: .*zero_config"):
        deepspeed.DeepSpeedConfig(CONFIG).hybrid_engine
    with pytest.raises(ValueError, match="mesh_device=...\) is not supported"):
        deepspeed.DeepSpeedConfig(CONFIG, mesh_device=object())
    assert deepspeed.DeepSpeedConfig({"train_batch_size": 2}).communication_data_type is None
    assert deepspeed.DeepSpeedConfig({"train_batch_size": 2, "torch_autocast": {
        "enabled": True, "dtype": "bf16"}}).torch_autocast_dtype == torch.bfloat16


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("DEEPSPEED_PYTHON"), reason="set DEEPSPEED_PYTHON to an interpreter with "
                    "DeepSpeed 0.19.8 to compare with it")
def test_deepspeed_answers_the_same():
    script = "import json, sys, deepspeed\n" + inspect.getsource(_answers) + (
        "print(json.dumps(_answers(deepspeed.DeepSpeedConfig(json.loads(sys.argv[1])), json.loads(sys.argv[2]))))\n")
    assert deepspeed_json(script, json.dumps(CONFIG), json.dumps(NAMES), timeout=600) == EXPECTED
