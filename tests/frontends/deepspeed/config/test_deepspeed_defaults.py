"""Every key of DeepSpeed 0.19.8's config models, set to DeepSpeed's own default, loads:
a config that writes a setting out at its default (generated configs do) asks for nothing
DeepSpeed would not do, so refusing it would be unfair. The defaults are DeepSpeed's (its
pydantic models' fields, read off DeepSpeed 0.19.8; with DEEPSPEED_PYTHON set, read again
and compared). zenflow's `steps_per_epoch`, which DeepSpeed sets itself and tells users
not to, is left out."""

import os

import pytest

from shardwise.frontends.deepspeed.config import load_config
from tests.frontends.deepspeed.deepspeed_side import deepspeed_json

DEFAULTS = {
    "zero_optimization": {
        "stage": 0, "contiguous_gradients": True, "reduce_scatter": True, "reduce_bucket_size": 500000000,
        "use_multi_rank_bucket_allreduce": True, "allgather_partitions": True, "allgather_bucket_size": 500000000,
        "overlap_comm": None, "compute_grad_norm": True, "load_from_fp32_weights": True,
        "elastic_checkpoint": False, "sub_group_size": 1000000000, "stage3_prefetch_bucket_size": 50000000,
        "stage3_param_persistence_threshold": 100000, "stage3_model_persistence_threshold": 9223372036854775807,
        "stage3_max_live_parameters": 1000000000, "stage3_max_reuse_distance": 1000000000,
        "stage3_gather_16bit_weights_on_model_save": False, "stage3_module_granularity_threshold": 0,
        "stage3_use_all_reduce_for_fetch_params": False, "stage3_allgather_sequential": False,
        "ignore_unused_parameters": True, "legacy_stage1": False, "round_robin_gradients": False,
        "parameter_alignment": False, "zero_hpz_partition_size": 1, "zero_quantized_weights": False,
        "zero_quantized_nontrainable_weights": False, "zero_quantized_gradients": False,
        "memory_efficient_linear": True, "pipeline_loading_checkpoint": False, "override_module_apply": True,
        "log_trace_cache_warnings": False, "enable_sanity_checks": False,
        "save_muon_momentum_buffer_in_memory": False,
    },
    "zero_optimization.offload_param": {
        "device": "none", "nvme_path": None, "buffer_count": 5, "buffer_size": 100000000, "max_in_cpu": 1000000000,
        "pin_memory": True,
    },
    "zero_optimization.offload_optimizer": {
        "device": "none", "nvme_path": None, "buffer_count": 4, "pin_memory": True, "pipeline_read": False,
        "pipeline_write": False, "fast_init": False, "ratio": 1.0, "super_offload": False,
        "cpuadam_cores_perc": 0.8,
    },
    "fp16": {
        "enabled": False, "auto_cast": False, "loss_scale": 0, "initial_scale_power": 16,
        "loss_scale_window": 1000, "hysteresis": 2, "consecutive_hysteresis": False, "min_loss_scale": 1,
        "fp16_master_weights_and_grads": False,
    },
    "bf16": {
        "enabled": False, "immediate_grad_update": False, "check_grad_overflow": True,
        "bf16_master_weights_and_grads": False, "bf16_optimizer_states": False,
    },
    "tensorboard": {
        "enabled": False, "output_path": "", "job_name": "DeepSpeedJobName",
    },
    "wandb": {
        "enabled": False, "group": None, "team": None, "project": "deepspeed",
    },
    "csv_monitor": {
        "enabled": False, "output_path": "", "job_name": "DeepSpeedJobName",
    },
    "comet": {
        "enabled": False, "samples_log_interval": 100, "project": None, "workspace": None, "api_key": None,
        "experiment_name": None, "experiment_key": None, "online": None, "mode": None,
    },
    "tensor_parallel": {
        "autotp_size": 0, "tp_overlap_comm": False, "vocab_parallel_lm_head": None,
        "vocab_parallel_ce_backend": "torch", "tp": {}, "injection_policy_tuple": None, "partition_config": None,
        "preset_model": None, "keep_module_on_host": False, "kernel_inject": False,
    },
    "zero_optimization.zenflow": {
        "topk_ratio": 0.1, "select_strategy": "auto", "select_interval": "auto", "update_interval": "auto",
        "overlap_step": False, "offload": False, "auto_ratio": 0.99, "full_warm_up_rounds": 0,
        "pt_reserved_cores_perc": 0.5,
    },
    "comms_logger": {
        "enabled": False, "prof_all": True, "prof_ops": [], "verbose": False, "debug": False,
    },
    "hybrid_engine": {
        "enabled": False, "max_out_tokens": 512, "inference_tp_size": 1, "release_inference_cache": False,
        "pin_parameters": True, "tp_gather_partition_size": 8, "enable_cuda_graph": False,
    },
    "zero_optimization.leaf_module": {
        "classes": ["transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
                    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
                    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock"],
        "names": [], "name_suffixes": [],
    },
    "timers.throughput": {
        "enabled": True, "synchronized": True,
    },
    "compile": {
        "deepcompile": False, "autoep_non_moe": False, "free_activation": False,
        "free_activation_threshold": 10485760, "offload_activation": False, "offload_activation_pin_memory": True,
        "offload_opt_states": False, "double_buffer": True, "symmetric_memory": False, "debug_log": False,
        "offload_parameters": False, "sync_before_reduce": False, "sync_after_reduce": False,
        "sync_before_allgather": False, "sync_after_allgather": False, "keep_int_input_tensors": True,
        "keep_all_input_tensors": False, "passes": None,
    },
}

BASE = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}


def config_setting(block: str, key: str, value: object) -> dict:
    """A config writing `block.key` at `value`, in a setting where the block is read."""
    if block == "zero_optimization":
        return {**BASE, "zero_optimization": {"stage": 2, key: value}}
    if block.startswith("zero_optimization."):
        inner = block.split(".", 1)[1]
        if inner == "leaf_module":
            return {**BASE, "zero_optimization": {"stage": 3, "leaf_module": {key: value}}}
        if inner == "zenflow":
            return {**BASE, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                                                  "zenflow": {key: value}}}
        device = {} if key == "device" else {"device": "cpu"}
        return {**BASE, "zero_optimization": {"stage": 3, inner: {**device, key: value}}}
    if block == "timers.throughput":
        return {**BASE, "timers": {"throughput": {key: value}}}
    return {**BASE, block: {key: value}}


@pytest.mark.parametrize("block", sorted(DEFAULTS))
def test_every_deepspeed_key_at_its_default_loads(block):
    refused = {}
    for key, value in DEFAULTS[block].items():
        try:
            load_config(config_setting(block, key, value), world_size=1)
        except Exception as error:  # noqa: BLE001 (every refusal is reported, by key)
            refused[key] = str(error)
    assert refused == {}


READ_DEEPSPEEDS = """
import enum, importlib, json, pathlib
from pydantic import BaseModel
MODELS = {"zero_optimization": "deepspeed.runtime.zero.config:DeepSpeedZeroConfig",
          "zero_optimization.offload_param": "deepspeed.runtime.zero.offload_config:DeepSpeedZeroOffloadParamConfig",
          "zero_optimization.offload_optimizer":
              "deepspeed.runtime.zero.offload_config:DeepSpeedZeroOffloadOptimizerConfig",
          "fp16": "deepspeed.runtime.precision_config:DeepSpeedFP16Config",
          "bf16": "deepspeed.runtime.precision_config:DeepSpeedBF16Config",
          "tensorboard": "deepspeed.monitor.config:TensorBoardConfig", "wandb": "deepspeed.monitor.config:WandbConfig",
          "csv_monitor": "deepspeed.monitor.config:CSVConfig", "comet": "deepspeed.monitor.config:CometConfig",
          "tensor_parallel": "deepspeed.runtime.tensor_parallel.config:TPTrainingConfig",
          "zero_optimization.zenflow": "deepspeed.runtime.zenflow.zenflow_config:ZenFlowConfig",
          "comms_logger": "deepspeed.comm.config:CommsLoggerConfig",
          "hybrid_engine": "deepspeed.runtime.config:HybridEngineConfig",
          "zero_optimization.leaf_module": "deepspeed.runtime.zero.leaf_module_config:DeepSpeedZeroLeafModuleConfig",
          "timers.throughput": "deepspeed.utils.config:DeepSpeedThroughputTimerConfig",
          "compile": "deepspeed.compile.config:CompileConfig"}
out = {}
for block, path in MODELS.items():
    module, name = path.split(":")
    fields = {}
    for field_name, field in getattr(importlib.import_module(module), name).model_fields.items():
        value = field.get_default(call_default_factory=True)
        deprecated = (field.json_schema_extra or {}).get("deprecated")  # DeepSpeed's old names of other keys
        if field.is_required() or isinstance(value, BaseModel) or field_name == "steps_per_epoch" or deprecated:
            continue
        value = value.value if isinstance(value, enum.Enum) else value
        value = str(value) if isinstance(value, pathlib.Path) else value
        try:
            json.dumps(value)
        except TypeError:
            continue
        fields[field.alias or field_name] = value
    if block == "zero_optimization":
        fields = {k: v for k, v in fields.items()
                  if k not in ("offload_param", "offload_optimizer", "zenflow", "leaf_module")}
    out[block] = fields
print(json.dumps(out))
"""


@pytest.mark.skipif(not os.environ.get("DEEPSPEED_PYTHON"), reason="set DEEPSPEED_PYTHON to an interpreter with "
                    "DeepSpeed 0.19.8 to read its defaults again")
def test_the_defaults_are_deepspeeds():
    assert deepspeed_json(READ_DEEPSPEEDS) == DEFAULTS


@pytest.mark.parametrize(("key", "value", "reason"), [
    ("tp_overlap_comm", True, "overlapping the tensor-parallel all-reduce"),
    ("preset_model", "bloom", "give tensor_parallel.plan"),
    ("tp", {"tp_size": 2}, "use tensor_parallel.autotp_size"),
    ("vocab_parallel_ce_backend", "liger", "only torch's cross-entropy"),
])
def test_autotp_settings_away_from_their_defaults_are_refused_with_the_reason(key, value, reason):
    from shardwise.frontends.deepspeed.config import ConfigError

    with pytest.raises(ConfigError, match=reason):
        load_config({**BASE, "tensor_parallel": {key: value}}, world_size=1)
