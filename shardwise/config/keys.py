"""Which keys a config may contain, and what to tell the user about the others.

A key is one of: supported (a field of the schema), an older DeepSpeed name for a
supported key (renamed), a DeepSpeed key shardwise does not implement (rejected by
name, so the user knows it was understood), or unknown (most likely a typo: rejected
with the closest supported key at the same level). The lists of DeepSpeed keys come
from deepspeed/runtime/constants.py, runtime/config.py and the section models under
deepspeed/runtime; they name what DeepSpeed accepts, not what it documents.
"""

import difflib
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from pydantic import BaseModel

from shardwise.config.errors import join_key
from shardwise.config.fields import Section
from shardwise.config.params import (
    DEEPSPEED_OPTIMIZERS_UNSUPPORTED,
    DEEPSPEED_SCHEDULERS_UNSUPPORTED,
    OPTIMIZER_PARAMS,
    OPTIMIZERS_NOT_YET,
    SCHEDULER_PARAMS,
)
from shardwise.config.schema import OptimizerConfig, SchedulerConfig, ShardwiseConfig, section_model

# Older names DeepSpeed still accepts. The zero_optimization ones are its pydantic field
# names, which it accepts beside the stage3_-prefixed aliases.
ALIASES: dict[str, dict[str, str]] = {
    "": {"bfloat16": "bf16"},
    "zero_optimization": {
        "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
        "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
        "prefetch_bucket_size": "stage3_prefetch_bucket_size",
        "param_persistence_threshold": "stage3_param_persistence_threshold",
        "max_live_parameters": "stage3_max_live_parameters",
        "max_reuse_distance": "stage3_max_reuse_distance",
    },
}

DEEPSPEED_KEYS_NOT_SUPPORTED: dict[str, frozenset[str]] = {
    "": frozenset({
        "amp", "autotuning", "checkpoint", "comet", "comms_logger", "compile", "compression_training",
        "csv_monitor", "curriculum_learning", "data_efficiency", "data_types", "dataloader_drop_last",
        "datastates", "disable_allgather", "dump_state", "eigenvalue", "elasticity", "expert_parallel",
        "flops_profiler", "fp32_allreduce", "gradient_allreduce_op", "gradient_predivide_factor",
        "graph_harvesting", "hybrid_engine", "log_level", "managed_gradient_accumulation",
        "memory_breakdown", "nebula", "pipeline", "prescale_gradients", "progressive_layer_drop",
        "quantize_training", "seq_parallel_comm_data_type", "sequence_parallel_size", "sparse_attention",
        "sparse_gradients", "timers", "torch_autocast", "use_data_before_expert_parallelism",
        "vocabulary_size", "wall_clock_breakdown", "wandb", "weight_quantization",
        "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer",
    }),
    "optimizer": frozenset({"legacy_fusion"}),
    "optimizer.params": frozenset({"max_grad_norm", "set_grad_none"}),
    "fp16": frozenset({"fp16_master_weights_and_grads", "fused_mode"}),
    "bf16": frozenset({
        "bf16_master_weights_and_grads", "bf16_optimizer_states", "check_grad_overflow", "immediate_grad_update",
    }),
    "zero_optimization": frozenset({
        "cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory", "elastic_checkpoint",
        "ignore_unused_parameters", "legacy_stage1", "load_from_fp32_weights", "log_trace_cache_warnings",
        "memory_efficient_linear", "mics_hierarchical_params_gather",
        "override_module_apply", "pipeline_loading_checkpoint", "round_robin_gradients",
        "stage3_model_persistence_threshold", "stage3_module_granularity_threshold",
        "stage3_use_all_reduce_for_fetch_params", "use_multi_rank_bucket_allreduce", "zenflow",
        "zero_hpz_partition_size", "zero_quantized_gradients", "zero_quantized_nontrainable_weights",
        "zero_quantized_weights", "zeropp_loco_param",
    }),
    "zero_optimization.offload_optimizer": frozenset({
        "fast_init", "pipeline", "pipeline_read", "pipeline_write", "ratio",
    }),
    "zero_optimization.offload_param": frozenset({"buffer_size", "max_in_cpu"}),
    "aio": frozenset({"intra_op_parallelism", "use_gds"}),
    "tensor_parallel": frozenset({
        "autotp_size", "keep_module_on_host", "partition_config", "preset_model", "replace_with_kernel_inject",
        "tp", "tp_overlap_comm",
    }),
}

# Where shardwise has the capability under another key, say which.
KEY_HINTS: dict[str, str] = {
    "optimizer.params.max_grad_norm": "use the top-level 'gradient_clipping' (DeepSpeed rejects it too)",
    "pipeline": "shardwise's block is 'pipeline_parallel'",
    "sequence_parallel_size": "shardwise's key is 'sequence_parallel.size'",
    "zero_optimization.cpu_offload": "use 'zero_optimization.offload_optimizer'",
    "zero_optimization.cpu_offload_param": "use 'zero_optimization.offload_param'",
    "tensor_parallel.autotp_size": "shardwise's key is 'tensor_parallel.size'",
}


class _TypedBlock(NamedTuple):
    """A block whose `params` keys depend on its `type`, with the types it cannot have."""

    model: type[BaseModel]
    params_by_type: dict[str, type[Section]]
    types_not_yet: tuple[str, ...]
    deepspeed_types_unsupported: tuple[str, ...]


_TYPED_BLOCKS = {
    "optimizer": _TypedBlock(OptimizerConfig, OPTIMIZER_PARAMS, OPTIMIZERS_NOT_YET, DEEPSPEED_OPTIMIZERS_UNSUPPORTED),
    "scheduler": _TypedBlock(SchedulerConfig, SCHEDULER_PARAMS, (), DEEPSPEED_SCHEDULERS_UNSUPPORTED),
}


def check_keys(raw: Mapping[str, Any], problems: list[str]) -> dict[str, Any]:
    """A copy of `raw` holding only supported keys under their current names; every other key
    becomes a line in `problems`. Sections given as null count as absent, as in DeepSpeed."""
    return _check_section(raw, ShardwiseConfig, "", problems)


def _check_section(
    raw: Mapping[str, Any], model: type[BaseModel], path: str, problems: list[str]
) -> dict[str, Any]:
    aliases = ALIASES.get(path, {})
    cleaned: dict[str, Any] = {}
    for key, value in raw.items():
        name = aliases.get(key, key)
        if name != key and name in raw:
            problems.append(
                f"'{join_key(path, key)}' and '{join_key(path, name)}' are both set; "
                f"'{key}' is DeepSpeed's other name for '{name}', keep one"
            )
        elif name in model.model_fields:
            checked = _check_value(value, model, name, join_key(path, name), problems)
            if checked is not None or section_model(model.model_fields[name].annotation) is None:
                cleaned[name] = checked
        else:
            problems.append(_describe_unsupported(key, model, path))
    return cleaned


def _check_value(value: Any, model: type[BaseModel], name: str, path: str, problems: list[str]) -> Any:
    if not isinstance(value, Mapping):
        return value
    if path in _TYPED_BLOCKS:
        return _check_typed_block(value, path, problems)
    nested = section_model(model.model_fields[name].annotation)
    return _check_section(value, nested, path, problems) if nested is not None else value


def _check_typed_block(raw: Mapping[str, Any], path: str, problems: list[str]) -> dict[str, Any] | None:
    """optimizer / scheduler: the valid `params` keys depend on `type`, so resolve `type` first.
    A type shardwise cannot build drops the whole block after reporting it."""
    block = _TYPED_BLOCKS[path]
    cleaned = _check_section(raw, block.model, path, problems)
    given = cleaned.get("type")
    if not isinstance(given, str):
        return cleaned
    canonical = _canonical_type(given, block.params_by_type)
    if canonical is None:
        problems.append(_describe_bad_type(given, path, block))
        return None
    cleaned["type"] = canonical
    if isinstance(cleaned.get("params"), Mapping):
        params_model = block.params_by_type[canonical]
        cleaned["params"] = _check_section(cleaned["params"], params_model, f"{path}.params", problems)
    return cleaned


def _canonical_type(given: str, names: Iterable[str]) -> str | None:
    """DeepSpeed matches its own optimizer names case-insensitively; shardwise does so for all."""
    return next((name for name in names if name.lower() == given.lower()), None)


def _describe_bad_type(given: str, path: str, block: _TypedBlock) -> str:
    choices = ", ".join(block.params_by_type)
    if _canonical_type(given, block.types_not_yet) is not None:
        return f"{path}.type '{given}' is not supported yet: use one of {choices}"
    if _canonical_type(given, block.deepspeed_types_unsupported) is not None:
        return f"{path}.type '{given}' is a DeepSpeed {path} that shardwise does not support yet: use one of {choices}"
    closest = _closest(given, list(block.params_by_type))
    if closest:
        return f"{path}.type '{given}' is unknown; did you mean '{closest}'? (choices: {choices})"
    return f"{path}.type '{given}' is unknown; use one of {choices}"


def _describe_unsupported(key: str, model: type[BaseModel], path: str) -> str:
    full = join_key(path, key)
    if key in DEEPSPEED_KEYS_NOT_SUPPORTED.get(path, frozenset()):
        hint = KEY_HINTS.get(full)
        return f"'{full}' is a DeepSpeed key that shardwise does not support yet" + (f": {hint}" if hint else "")
    closest = _closest(key, list(model.model_fields))
    if closest:
        return f"unknown key '{full}'; did you mean '{join_key(path, closest)}'?"
    where = f"in '{path}'" if path else "at the top level"
    return f"unknown key '{full}'; the keys accepted {where} are: {', '.join(model.model_fields)}"


def _closest(key: str, choices: list[str]) -> str | None:
    by_lower = {choice.lower(): choice for choice in choices}
    matches = difflib.get_close_matches(key.lower(), list(by_lower), n=1, cutoff=0.6)
    return by_lower[matches[0]] if matches else None
