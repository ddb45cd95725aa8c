"""DeepSpeed keys shardwise accepts without a schema field of its own.

DeepSpeed reads many keys that change nothing about the numbers a run computes: switches
for diagnostics, performance knobs of its own implementation, and blocks for features
that are switched off. Real configs carry them by the dozen (most of DeepSpeedExamples'
configs say `"wall_clock_breakdown": false`), so refusing them would refuse the configs.
Each key here is one of:

    Accepted       harmless at any value: it only tunes how DeepSpeed's own
                   implementation runs, or only affects diagnostics shardwise always has
                   (`engine.memory_breakdown()`, `engine.comm_volume()`, the step timer).
    AcceptedWhen   harmless at the values that switch it off (or keep DeepSpeed's
                   default); any other value would change training in a way shardwise
                   does not do, and is rejected with why and what to use instead.
    Translated     an older spelling of a capability shardwise has: the value is moved to
                   shardwise's key, so it is honoured.
    Ignored        DeepSpeed 0.19.8 parses it and changes nothing with it (or shardwise
                   computes the same without it): accepted at any value, and a value other
                   than the quiet ones is named in the one warning `load_config` logs.
    Removed        a feature DeepSpeed 0.19.8 has removed (it refuses the key at any value,
                   "has been removed"): switched on, refused with DeepSpeed's reason;
                   switched off, accepted and named in the warning, since DeepSpeed itself
                   would refuse the config.

Keys DeepSpeed itself ignores (it reads known keys from the top level and never looks at
the others) are accepted when their name marks them as comments: `"_comment"`,
`"comment"`, anything starting with `_` or `//`.

Sources: deepspeed/runtime/constants.py, runtime/config.py, runtime/zero/config.py,
runtime/zero/offload_config.py, runtime/precision_config.py, monitor/config.py,
runtime/model_checkpointing/constants.py,
profiling/config.py, comm/config.py, runtime/checkpoint_engine, compression/constants.py,
elasticity/constants.py, autotuning/constants.py, runtime/data_pipeline/constants.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Accepted:
    why: str
    # DeepSpeed 0.19.8's own check of the value: what is wrong with it, or "" where it reads
    # the value; a value it refuses at `initialize` is refused here too
    wrong: Callable[[Any], str] | None = None


@dataclass(frozen=True)
class AcceptedWhen:
    harmless: Callable[[Any], bool]
    harmless_doc: str  # the values accepted, as docs/reference/config.md shows them
    why_not: str  # why other values are refused, and what to use instead


@dataclass(frozen=True)
class Translated:
    """`convert(value)` returns {dotted shardwise key: value} to merge, or a refusal string.
    `replaced_by`: the key of the same block that DeepSpeed names as this deprecated key's
    replacement; it refuses the two together at any values (config_utils.py,
    `_process_deprecated_field`), and so does shardwise."""

    target: str
    convert: Callable[[Any], dict[str, Any] | str]
    replaced_by: str = ""


@dataclass(frozen=True)
class Ignored:
    quiet: Callable[[Any], bool]  # values not worth a warning (DeepSpeed's default)
    why: str  # what DeepSpeed does with it, as found by running DeepSpeed 0.19.8
    wrong: Callable[[Any], str] | None = None  # as Accepted's


@dataclass(frozen=True)
class Removed:
    """A feature DeepSpeed 0.19.8 has removed: it refuses the key at any value, even one
    that switches the feature off ("has been removed"), and so does shardwise."""

    why: str  # DeepSpeed 0.19.8's reason, and what to use instead


KeyRule = Accepted | AcceptedWhen | Translated | Ignored | Removed


def _is(expected: Any) -> Callable[[Any], bool]:
    return lambda value: value == expected and isinstance(value, bool) == isinstance(expected, bool)


def _is_none(value: Any) -> bool:
    return value is None


def _one_of(*choices: str | None) -> Callable[[Any], bool]:
    """A string among `choices` in any case (DeepSpeed upper-cases before it checks), or None if listed."""
    names = {choice.upper() for choice in choices if choice is not None}
    return lambda value: (value is None and None in choices) or (isinstance(value, str) and value.upper() in names)


def _engine_switch(value: Any) -> str:
    """DeepSpeed's engine ORs the value with a bool: a bool or an integer works, anything
    else fails there ("unsupported operand type(s) for |")."""
    return "" if isinstance(value, int) else f"must be true or false (DeepSpeed 0.19.8 fails on {value!r} too)"


def _module_names(value: Any) -> str:
    """DeepSpeed requires every entry to be a module's dotted class name."""
    if value is None or isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        return ""
    return ("must be a list of module class names such as \"torch.nn.Linear\" (DeepSpeed 0.19.8 refuses "
            "anything else: \"Expected list of strings\")")


def _pipeline_stage_switch(value: Any) -> str:
    """DeepSpeed accepts `pipeline_stage` true or false (or 1 / 0, equal to them) and
    refuses any other value."""
    stage = value.get("pipeline_stage", False) if isinstance(value, dict) else False
    if isinstance(stage, (bool, int)) and stage in (True, False):
        return ""
    return (f"pipeline_stage {stage!r} must be true or false (DeepSpeed 0.19.8 refuses it too: \"expecting: true "
            "or false\")")


def _disabled(block: Any) -> bool:
    """A block that is off: absent `enabled` means DeepSpeed's default, off."""
    return block is None or block is False or (isinstance(block, dict) and block.get("enabled", False) is False)


def _at_most_one(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value <= 1


OFF = "false (or a block with enabled false)"
DIAGNOSTICS = "only affects what DeepSpeed logs"
_NO_KERNEL_INJECTION = AcceptedWhen(_is(False), "false", "inference kernel injection is not provided")


def _cpu_offload(target_device: str) -> Callable[[Any], dict[str, Any] | str]:
    def convert(value: Any) -> dict[str, Any] | str:
        if value is True:
            return {f"{target_device}.device": "cpu"}
        if value is False:
            return {}
        return f"must be true or false, got {value!r}"

    return convert


def _pin_memory(value: Any) -> dict[str, Any] | str:
    if not isinstance(value, bool):
        return f"must be true or false, got {value!r}"
    return {"offload_optimizer.pin_memory": value}


def _sequence_parallel_size(value: Any) -> dict[str, Any] | str:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return f"must be a positive integer, got {value!r}"
    return {} if value == 1 else {"sequence_parallel.size": value, "sequence_parallel.mode": "ulysses"}


def _autotp_size(value: Any) -> dict[str, Any] | str:
    """DeepSpeed's AutoTP training size: 0 (its default) switches it off, like 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return f"must be a non-negative integer (0 = off), got {value!r}"
    return {} if value <= 1 else {"size": value}


# DeepSpeed's names for the dtypes of `data_types` (runtime/config.py `DtypeEnum`), int8 left out:
# no gradient accumulates, and no parameter trains, in it.
DATA_TYPE_NAMES = {
    **dict.fromkeys(("fp32", "float32", "float", "torch.float32"), "fp32"),
    **dict.fromkeys(("fp16", "float16", "half", "torch.float16"), "fp16"),
    **dict.fromkeys(("bf16", "bfloat16", "torch.bfloat16"), "bf16"),
}


# DeepCompile's settings (deepspeed/compile/config.py) with DeepSpeed's defaults: they tune the
# graph passes that `engine.compile()` runs with compile.deepcompile true.
_DEEPCOMPILE_SETTINGS = {
    "autoep_non_moe": False, "free_activation": False, "free_activation_threshold": 10 * 1024 * 1024,
    "offload_activation": False, "offload_activation_pin_memory": True, "offload_opt_states": False,
    "double_buffer": True, "symmetric_memory": False, "debug_log": False, "offload_parameters": False,
    "sync_before_reduce": False, "sync_after_reduce": False, "sync_before_allgather": False,
    "sync_after_allgather": False, "keep_int_input_tensors": True, "keep_all_input_tensors": False,
}
_DEEPCOMPILE_WHY = ("a setting of DeepCompile's graph passes, which shardwise replaces by its run-time ZeRO with "
                    "torch.compile per block (compile.deepcompile): the training results are the same, DeepCompile's "
                    "own memory savings (its offloads, freeing) are not made")

RULES: dict[str, dict[str, KeyRule]] = {
    "": {
        "wall_clock_breakdown": Accepted(f"{DIAGNOSTICS}; shardwise's step timer always splits each step into "
                                         "forward / backward / communication wait / optimizer", _engine_switch),
        "memory_breakdown": Accepted(f"{DIAGNOSTICS}; engine.memory_breakdown() is always available"),
        "dump_state": Accepted(f"{DIAGNOSTICS} (it prints the engine's state at start-up)"),
        "log_level": Accepted(DIAGNOSTICS),
        "timers": Accepted(f"{DIAGNOSTICS} (throughput timers)"),
        "zero_allow_untested_optimizer": Accepted("shardwise runs any torch optimizer under every ZeRO stage"),
        "zero_force_ds_cpu_optimizer": Accepted("with the optimizer offloaded, shardwise runs the optimizer you "
                                                "gave on the host; there is no separate CPU Adam to force"),
        "comms_logger": Accepted("deepspeed.initialize configures deepspeed.comm's logger from it, which times the "
                                 "collectives a script calls through deepspeed.comm (deepspeed.comm.log_summary()); "
                                 "the engine's own are counted by engine.comm_volume(per_group=True), bytes per "
                                 "group and operation"),
        "prescale_gradients": Accepted("shardwise always divides each gradient by the data-parallel size before "
                                       "summing it (DeepSpeed's true; false sums first): the same average, rounded "
                                       "in a different order"),
        "gradient_predivide_factor": Accepted("splits DeepSpeed's division into one before and one after the "
                                              "sum; the average is the same, and shardwise divides before summing"),
        "fp32_allreduce": Ignored(_is(False), "DeepSpeed 0.19.8 no longer reads it: gradients are reduced in "
                                  "communication_data_type (default: the training dtype), as there; set "
                                  "\"communication_data_type\": \"fp32\" to reduce in fp32"),
        "sparse_gradients": Removed("sparse compression of dense embedding gradients; gradients "
                                    "are reduced dense: remove the key"),
        "disable_allgather": Ignored(_is(False), "DeepSpeed parses it and no code reads it: ZeRO 1-2 all-gather "
                                     "the updated partitions either way"),
        "amp": Removed("NVIDIA Apex AMP: remove the block; use the bf16, fp16 or torch_autocast block"),
        "elasticity": Removed("elastic training: remove the block and set the batch sizes directly "
                              "(shardwise checkpoints load at another world size)"),
        "compression_training": Removed("the compression library (quantization, pruning, layer "
                                        "reduction during training): remove the block"),
        "quantize_training": Removed("Mixture-of-Quantization (MoQ): remove the block"),
        "weight_quantization": AcceptedWhen(lambda v: not v, "{} or absent", "weight quantization is not "
                                            "supported: remove the block"),
        "progressive_layer_drop": Removed("progressive layer dropping: remove the block"),
        "curriculum_learning": Removed("the legacy top-level curriculum learning: remove the block; "
                                       "data_efficiency.data_sampling.curriculum_learning, where DeepSpeed moved it, "
                                       "runs in shardwise"),
        "eigenvalue": Removed("eigenvalue-based MoQ: remove the block"),
        "hybrid_engine": Accepted("speed only: DeepSpeed-Chat's hybrid engine swaps the actor into DeepSpeed's "
                                  "inference kernels for `generate`; shardwise generates with the same module "
                                  "(ZeRO-3 gathers its parameters as for any forward), so the samples and the "
                                  "training are the same"),
        "nebula": Removed("Nebula checkpointing: remove the block (shardwise writes its own atomic "
                          "checkpoints)"),
        "datastates": AcceptedWhen(_disabled, OFF, "DataStates checkpointing is not used"),
        "graph_harvesting": Removed("CUDA graph harvesting: remove the key"),
        "sequence_parallel_size": Translated("sequence_parallel.size", _sequence_parallel_size),
        "seq_parallel_communication_data_type": Accepted("the dtype of Ulysses' all-to-all in DeepSpeed; "
                                                         "shardwise sends activations in their own dtype"),
        "pipeline": Accepted("read only by DeepSpeed's PipelineModule; shardwise's block is "
                             "'pipeline_parallel'"),
    },
    "fp16": {
        "fp16_master_weights_and_grads": AcceptedWhen(_is(False), "false", "shardwise keeps fp32 master weights "
                                                      "(the ZeRO paper's mixed precision); remove the key"),
        "fused_mode": Accepted("a DeepSpeed kernel choice"),
    },
    "bf16": {
        "check_grad_overflow": Accepted("shardwise always checks gradients for non-finite values before a "
                                        "step (reliability.step_guard)"),
        "immediate_grad_update": Accepted("a DeepSpeed implementation detail of bf16 gradient accumulation"),
    },
    "optimizer": {
        "legacy_fusion": Accepted("a DeepSpeed kernel choice"),
    },
    "optimizer.params": {
        "set_grad_none": Accepted("gradients are always released after the step"),
    },
    "tensor_parallel": {
        "autotp_size": Translated("tensor_parallel.size", _autotp_size),
        # DeepSpeed 0.19.8's AutoTP training keys at their defaults (TPTrainingConfig)
        "tp_overlap_comm": AcceptedWhen(_is(False), "false", "overlapping the tensor-parallel all-reduce with "
                                        "computation is not provided"),
        "vocab_parallel_lm_head": AcceptedWhen(_is_none, "null", "the LM head is split as the model's "
                                               "plan says (null, DeepSpeed's default, follows the plan); give "
                                               "tensor_parallel.plan to choose"),
        "vocab_parallel_ce_backend": AcceptedWhen(_one_of("torch"), '"torch"', "only torch's cross-entropy is "
                                                  "provided"),
        "tp": AcceptedWhen(lambda v: v in ({}, None), "{}", "DeepSpeed's inner tensor-parallel block (tp_size, "
                           "tp_grain_size) is not read: use tensor_parallel.autotp_size"),
        "injection_policy_tuple": AcceptedWhen(_is_none, "null", "DeepSpeed's kernel-injection policies "
                                               "are not provided: give tensor_parallel.plan"),
        "partition_config": AcceptedWhen(_is_none, "null", "DeepSpeed's AutoTP layer specs are not read: "
                                         "give the same split as tensor_parallel.plan ({\"pattern\": \"colwise\" | "
                                         "\"rowwise\"})"),
        "preset_model": AcceptedWhen(_one_of(None, "llama", "qwen2", "mixtral", "phi3"),
                                     'null, "llama", "qwen2", "mixtral", "phi3"',
                                     "shardwise plans these families itself (by the model); bloom, chatglm and "
                                     "deepseek_v2 have no built-in plan: give tensor_parallel.plan"),
        "keep_module_on_host": AcceptedWhen(_is(False), "false", "loading checkpoints onto the host first is not "
                                            "provided"),
        "kernel_inject": _NO_KERNEL_INJECTION,
        "replace_with_kernel_inject": _NO_KERNEL_INJECTION,  # the same key under its field name
    },
    "zero_optimization": {
        "cpu_offload": Translated("zero_optimization.offload_optimizer.device", _cpu_offload("offload_optimizer"),
                                  replaced_by="offload_optimizer"),
        "cpu_offload_param": Translated("zero_optimization.offload_param.device", _cpu_offload("offload_param"),
                                        replaced_by="offload_param"),
        "cpu_offload_use_pin_memory": Translated("zero_optimization.offload_optimizer.pin_memory", _pin_memory),
        "round_robin_gradients": Accepted("orders DeepSpeed's gradient copies to the host; the result is the same"),
        "elastic_checkpoint": Accepted("shardwise checkpoints always load at another world size"),
        "load_from_fp32_weights": Accepted("shardwise always restores the fp32 masters from the checkpoint"),
        "legacy_stage1": AcceptedWhen(_is(False), "false", "DeepSpeed's legacy stage-1 implementation does not "
                                      "exist in shardwise: remove the key"),
        "log_trace_cache_warnings": Accepted(DIAGNOSTICS),
        "memory_efficient_linear": Accepted("shardwise's stage 3 already frees a linear's gathered weight "
                                            "after its forward"),
        "override_module_apply": Accepted("a detail of DeepSpeed's zero.Init patching"),
        "use_multi_rank_bucket_allreduce": Accepted("a DeepSpeed bucketing choice"),
        "compute_grad_norm": Accepted("speed only (DeepSpeed's stages 1-2 can skip the norm without clipping): "
                                      "shardwise computes the gradient norm in the step check that also finds "
                                      "non-finite gradients, so get_global_grad_norm() answers either way"),
        "stage3_allgather_sequential": Accepted("how DeepSpeed's stage 3 issues its gathers (one per parameter, not "
                                                "bucketed); shardwise gathers by unit, the same values"),
        "parameter_alignment": Accepted("pads DeepSpeed's stage 1-2 flat buffers so each parameter starts on 16 "
                                        "bytes; a memory layout, the same training"),
        "enable_sanity_checks": Accepted(f"{DIAGNOSTICS} (its internal debugging checks)"),
        "save_muon_momentum_buffer_in_memory": Accepted("with Muon and NVMe offload, where DeepSpeed keeps Muon's "
                                                        "momentum; a placement, the same training"),
        "stage3_model_persistence_threshold": Accepted("a cap on the total size of persistent parameters; "
                                                       "stage3_param_persistence_threshold decides per parameter"),
        "stage3_use_all_reduce_for_fetch_params": AcceptedWhen(_is(False), "false", "parameters are fetched "
                                                               "by all-gather"),
        "pipeline_loading_checkpoint": AcceptedWhen(_is(False), "false", "for DeepSpeed's pipeline engine only"),
        "mics_hierarchical_params_gather": AcceptedWhen(_is(False), "false", "the shard group gathers in one "
                                                        "step; use mics_shard_size alone"),
        "zero_quantized_nontrainable_weights": AcceptedWhen(_is(False), "false",
                                                            "frozen weights stored in int8 are not supported (ZeRO++'s "
                                                            "zero_quantized_weights quantizes what gathers carry)"),
        "zeropp_loco_param": AcceptedWhen(_is_none, "null", "ZeRO++ LoCo is not supported"),
    },
    "zero_optimization.offload_optimizer": {
        "fast_init": Accepted("only how fast DeepSpeed initialises its swap files"),
        "pipeline": Accepted("shardwise always overlaps NVMe reads and writes with the optimizer step"),
        "pipeline_read": Accepted("shardwise always reads the next sub-group ahead"),
        "pipeline_write": Accepted("shardwise always writes the previous sub-group behind"),
        "super_offload": Accepted("speed only: DeepSpeed's SuperOffload (CUDA Superchips) starts the CPU step "
                                  "during backward and rolls it back on overflow; the step it keeps is the one "
                                  "shardwise's CPU offload takes"),
        "cpuadam_cores_perc": Accepted("the share of the cores DeepSpeed's CPU Adam takes under SuperOffload; "
                                       "shardwise's CPU step uses torch's thread count"),
    },
    "zero_optimization.offload_param": {
        "max_in_cpu": Accepted("the size of DeepSpeed's host cache of NVMe parameters; shardwise keeps no "
                               "cache (a shard is read at each gather)"),
    },
    "compile": {key: Ignored(_is(default), _DEEPCOMPILE_WHY) for key, default in _DEEPCOMPILE_SETTINGS.items()},
    "torch_autocast": {
        "lower_precision_safe_modules": Ignored(_is_none, "the modules whose gradients DeepSpeed "
                                                "all-reduces in the autocast dtype; shardwise reduces every "
                                                "gradient in communication_data_type (default: the parameters' "
                                                "fp32), the same sum rounded less", _module_names),
    },
    "checkpoint": {
        "checkpoint_serialization": Accepted("the serialization of DeepSpeed's torch.save files; shardwise writes "
                                             "safetensors and JSON, never pickles"),
        "load_universal": Accepted("DeepSpeed's universal checkpoints load at another parallel layout; shardwise "
                                   "checkpoints always do"),
        "use_node_local_storage": Accepted("where DeepSpeed's ranks write on each node; every shardwise rank "
                                           "writes its share into the one checkpoint folder"),
        "parallel_write": Accepted("DeepSpeed's pipeline stages writing their layer files in parallel; every "
                                   "shardwise rank writes its own share in parallel always", _pipeline_stage_switch),
    },
    "checkpoint.writer": {
        "type": AcceptedWhen(_one_of("fast", "python"), '"fast" or "python" (any case)',
                             "DeepSpeed's mock writer writes no files (an I/O benchmark); shardwise always writes a "
                             "loadable checkpoint: use fast or python, or remove the key"),
        "io_buffer_size": Accepted("the pinned buffer of DeepSpeed's fast file writer; shardwise streams each "
                                   "rank's share into its safetensors file"),
        "io_buffer_double": Accepted("double buffering in DeepSpeed's fast file writer"),
        "io_multiplier": Accepted("how many files DeepSpeed's fast writer splits a rank's share into"),
        "show_statistics": Accepted(DIAGNOSTICS),
        "data_parallel": AcceptedWhen(_one_of("replica", "socket", "machine", None),
                                      '"replica", "socket", "machine" (any case) or null',
                                      "DeepSpeed accepts only these units for its parallel writers"),
    },
    "data_efficiency.data_sampling": {
        "dynamic_batching": AcceptedWhen(_disabled, OFF, "dynamic batching (variable batch size and learning rate "
                                         "by token count) is not supported: batch in your data loader"),
    },
    "aio": {
        "intra_op_parallelism": Accepted("a libaio threading knob; shardwise's swap uses aio.thread_count"),
        "use_gds": AcceptedWhen(_is(False), "false", "GPUDirect Storage is not used"),
    },
}

# Features DeepSpeed 0.19.8 has removed (it refuses these keys) that shardwise keeps and
# honours, with the schema field that holds each.
KEPT_AFTER_DEEPSPEED_REMOVED: dict[str, str] = {
    "sparse_attention": "block-sparse attention layouts for every attention layer (shardwise.ops.sparse_attention)",
    "zero_optimization.mics_shard_size": "hybrid sharding: states sharded within groups of this many ranks, "
                                         "replicated across groups (MiCS / HSDP)",
}

COMMENT_PREFIXES = ("_", "//", "#")
COMMENT_NAMES = frozenset({"comment", "comments", "description", "note", "notes"})


def is_comment(key: str, path: str) -> bool:
    """Top-level keys DeepSpeed never reads and whose name says they are notes for people."""
    return path == "" and (key.startswith(COMMENT_PREFIXES) or key.lower() in COMMENT_NAMES)


def rule_for(path: str, key: str) -> KeyRule | None:
    return RULES.get(path, {}).get(key)


def classification_rows() -> list[tuple[str, str, str]]:
    """(dotted key, how shardwise treats it, why) for docs/reference/config.md's table."""
    rows = []
    for path, rules in RULES.items():
        for key, rule in rules.items():
            dotted = f"{path}.{key}" if path else key
            if isinstance(rule, Accepted):
                rows.append((dotted, "accepted, any value DeepSpeed reads" if rule.wrong else "accepted, any value",
                             rule.why))
            elif isinstance(rule, AcceptedWhen):
                rows.append((dotted, f"accepted when {rule.harmless_doc}; otherwise rejected", rule.why_not))
            elif isinstance(rule, Ignored):
                rows.append((dotted, "accepted and ignored (named in the warning)", rule.why))
            elif isinstance(rule, Removed):
                rows.append((dotted, "removed by DeepSpeed 0.19.8: rejected at any value, as DeepSpeed does",
                             f"DeepSpeed 0.19.8 refuses the key (\"has been removed\"): {rule.why}"))
            else:
                rows.append((dotted, f"honoured as `{rule.target}`", "an older DeepSpeed spelling"))
    for dotted, what in KEPT_AFTER_DEEPSPEED_REMOVED.items():
        rows.append((dotted, "honoured (DeepSpeed 0.19.8 has removed it)",
                     f"{what}; DeepSpeed 0.19.8 refuses the key (\"has been removed\"), shardwise keeps it"))
    return rows
