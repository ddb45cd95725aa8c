"""The configuration schema: DeepSpeed's JSON keys, resolved, with DeepSpeed's defaults.

Defaults follow DeepSpeed's code, not its documentation where the two disagree:
deepspeed/runtime/zero/config.py and zero/offload_config.py (ZeRO and offload),
runtime/precision_config.py and runtime/constants.py (fp16, bf16, batch, clipping),
runtime/activation_checkpointing/config.py, runtime/swap_tensor/constants.py (aio),
monitor/config.py (tensorboard) and runtime/lr_schedules.py (schedulers, in params.py).
`steps_per_print` keeps DeepSpeed's long-standing 10 although its newest code
defaults to None (never print), because shardwise's progress output needs a period.

These models describe a config that is already resolved: `load_config` turns
"auto" into values, derives the batch sizes and reports every problem at once,
so build configs through it rather than by instantiating these classes.
"""

import math
import sys
from typing import Any, Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from shardwise.formulas.stages import STAGES, partitions_parameters
from shardwise.frontends.deepspeed.config.data_efficiency import DataEfficiencyConfig
from shardwise.frontends.deepspeed.config.fields import Bool, Float, Int, Section
from shardwise.runtime.optim.registry import optimizer_spec
from shardwise.runtime.optim.schedulers import SCHEDULERS
from shardwise.runtime.optim.torch_by_name import torch_scheduler_class
from shardwise.runtime.optim.torch_optimizers import constructor_kwargs, torch_class_name

# fp16's largest finite value is 65504, just under 2**16.
FP16_MAX_EXPONENT = 16
# 2**64 already overflows fp16 gradients for ~48 steps; fp32 itself ends near 2**128.
MAX_INITIAL_SCALE_POWER = 64


class Fp16Config(Section):
    """fp16 mixed precision; `loss_scale` 0 selects dynamic loss scaling. `auto_cast`:
    DeepSpeed casts the forward's floating-point inputs to fp16, which shardwise does for
    every 16-bit run (runtime/precision/casting.py)."""

    enabled: Bool = False
    auto_cast: Bool = False
    loss_scale: Float = Field(0.0, ge=0)
    # Their ranges matter only to dynamic loss scaling (config/checks.py
    # `_dynamic_scaling_contradictions`): DeepSpeed 0.19.8 takes any value when fp16 is off or
    # its scale static, and so does shardwise.
    initial_scale_power: Int = 16
    loss_scale_window: Int = 1000
    hysteresis: Int = 2
    consecutive_hysteresis: Bool = False
    min_loss_scale: Int = 1

    @field_validator("min_loss_scale", mode="before")
    @classmethod
    def _whole_min_loss_scale(cls, floor: Any) -> Any:
        """DeepSpeed 0.19.8 declares the floor an integer and refuses a fraction, at any
        setting of `enabled` (runtime/precision_config.py)."""
        if isinstance(floor, float) and math.isfinite(floor) and not floor.is_integer():
            raise ValueError(f"{floor} is not a whole number: DeepSpeed 0.19.8 reads the dynamic loss scale's floor "
                             "as an integer and refuses a fraction too; give a whole number (its default is 1)")
        return floor


class Bf16Config(Section):
    """bf16 mixed precision; needs no loss scaling thanks to fp32's exponent range.
    `bf16_master_weights_and_grads`: ZeRO keeps the master weights and the gradient
    partition in bf16 instead of fp32; `bf16_optimizer_states` (which needs it): the
    optimizer's states too, as DeepSpeed's ZeRO does (half the bytes of fp32 masters:
    docs/formulas.md#optimizer-state-bytes-k)."""

    enabled: Bool = False
    bf16_master_weights_and_grads: Bool = False
    bf16_optimizer_states: Bool = False

    @model_validator(mode="after")
    def _states_need_masters(self) -> "Bf16Config":
        if self.bf16_optimizer_states and not self.bf16_master_weights_and_grads:
            raise ValueError("bf16_optimizer_states true needs bf16_master_weights_and_grads true: the optimizer "
                             "states follow the master weights' dtype (DeepSpeed asks the same)")
        return self


# DeepSpeed's spellings of the training dtypes (runtime/config.py `DtypeEnum`, int8 left out:
# nothing trains or accumulates in it); config/deepspeed_keys.py `DATA_TYPE_NAMES` names each.
DtypeName = Literal["bf16", "bfloat16", "torch.bfloat16", "fp16", "float16", "half", "torch.float16",
                    "fp32", "float32", "float", "torch.float32"]


class DataTypesConfig(Section):
    """DeepSpeed's `data_types`. `grad_accum_dtype`: the dtype micro-batch gradients are
    summed in; fp32 beside bf16/fp16 keeps ZeRO's gradient buffers in fp32 at stages 1-3
    (each micro-batch's gradient is still computed in the training dtype and added in);
    unset or the training dtype: the sum is kept in the training dtype. `param_dtype`: the
    training dtype again (DeepSpeed refuses any other). config/checks.py holds both against
    the precision the config trains in."""

    grad_accum_dtype: DtypeName | None = Field(None, json_schema_extra={
        "default_doc": "the training dtype; fp32 beside bf16/fp16 (ZeRO stages 1-3): micro-batch gradients summed "
                       "in fp32"})
    param_dtype: DtypeName | None = Field(None, json_schema_extra={"default_doc": "the training dtype (the only "
                                                                   "value accepted)"})


class TorchAutocastConfig(Section):
    """DeepSpeed's `torch_autocast`: the forward runs under `torch.autocast(dtype)` while the
    parameters, their gradients and the optimizer stay fp32 (`dtype` unset: torch's default
    for the device, bf16 on CPU and fp16 on CUDA); fp16 autocast scales the loss as the fp16
    block's settings say."""

    enabled: Bool = False
    dtype: DtypeName | None = None


class OffloadConfig(Section):
    """Where a ZeRO partition lives between uses; "none" keeps it on the accelerator.
    `pin_memory`, as in DeepSpeed: the host buffers of the offloaded state are page-locked
    (optimizer offload: the fp32 masters, the gradient partition and the staging buffers
    reduced gradients are copied into; parameter offload: the host shards), so copies
    between device and host run asynchronously; it applies only when CUDA is available."""

    device: Literal["none", "cpu", "nvme"] = "none"
    nvme_path: str | None = None
    pin_memory: Bool = False


class OffloadOptimizerConfig(OffloadConfig):
    """Optimizer-state offload; 4 buffers hold Adam's parameter, gradient and two moments.
    `ratio`: the fraction of the partition offloaded (ZeRO-Offload++ Twin-Flow); the rest
    stays on the device and is updated there (offload/split_store.py)."""

    buffer_count: Int = Field(4, ge=0)
    ratio: Float = Field(1.0, le=1)

    @field_validator("ratio")
    @classmethod
    def _offloads_something(cls, ratio: float) -> float:
        """DeepSpeed accepts 0 and then offloads nothing while the device says "cpu"."""
        if ratio <= 0:
            raise ValueError(f"ratio {ratio} offloads no part of the optimizer state: give the fraction to offload "
                             "in (0, 1], or set offload_optimizer.device to \"none\" to keep it all on the device")
        return ratio


class OffloadParamConfig(OffloadConfig):
    """Parameter offload (stage 3), whose NVMe buffer pool DeepSpeed sizes at 5 by default.
    With NVMe, at most `buffer_count` x `buffer_size` elements of shards are in host
    memory at once (offload/param_home.py); a buffer must hold the largest shard."""

    buffer_count: Int = Field(5, ge=0)
    buffer_size: Int = Field(100_000_000, ge=1)


# DeepSpeed 0.19.8's defaults (runtime/zero/leaf_module_config.py): Hugging Face's sparse MoE
# blocks, whose experts run only on the tokens routed to them, are gathered whole at stage 3
DEFAULT_LEAF_MODULE_CLASSES = (
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
)


class LeafModuleConfig(Section):
    """Modules whose parameters stage 3 gathers whole when they are entered, with no hooks
    below them (runtime/zero/leaf_modules.py): by class name (bare or module-qualified),
    module path, or path suffix. A single string counts as a list of one, as in DeepSpeed."""

    classes: list[str] = Field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_CLASSES),
                               json_schema_extra={"default_doc": "Mixtral's, Qwen2-MoE's and Qwen3-MoE's sparse MoE "
                                                                 "blocks"})
    names: list[str] = Field(default_factory=list)
    name_suffixes: list[str] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _one_string_is_a_list(cls, values: Any) -> Any:
        if isinstance(values, dict):
            return {key: [value] if key in ("classes", "names", "name_suffixes") and isinstance(value, str) else value
                    for key, value in values.items()}
        return values


class ZenFlowConfig(Section):
    """ZenFlow (runtime/zero/zenflow.py), read as DeepSpeed 0.19.8 reads it: the top
    `topk_ratio` gradient columns updated on the device every step, the rest accumulated
    and applied by the CPU optimizer every `update_interval` steps. `select_strategy`
    "step" reselects every `select_interval` steps; "epoch" (and "auto", which is "epoch"
    with an interval of 1) every `select_interval` epochs of the training data given to
    `initialize`, or, without it, only once after the `full_warm_up_rounds` ordinary
    offloaded steps. `update_interval` "auto" runs as DeepSpeed 0.19.8 runs it: CPU
    updates during warm-up and at every selection boundary only (runtime/zero/zenflow.py).
    `overlap_step` runs the CPU update in the background and applies it one update later
    (runtime/zero/zenflow_overlap.py). `offload` (the selective state on the host) and
    `pt_reserved_cores_perc` only place memory and threads."""

    topk_ratio: Float = Field(0.1, gt=0.0, lt=1.0)
    select_strategy: Literal["auto", "step", "epoch"] = "auto"
    select_interval: Int | Literal["auto"] = "auto"
    update_interval: Int | Literal["auto"] = "auto"
    overlap_step: Bool = False
    offload: Bool = False
    auto_ratio: Float = Field(0.99, ge=0.0, le=1.0)
    full_warm_up_rounds: Int = Field(0, ge=0)
    pt_reserved_cores_perc: Float = Field(0.5, ge=0.0, le=1.0)

    @model_validator(mode="after")
    def _supported(self) -> "ZenFlowConfig":
        if self.update_interval != "auto" and self.update_interval < 1:
            raise ValueError(f"zenflow.update_interval must be at least 1, got {self.update_interval}")
        if self.select_strategy == "auto" and self.select_interval != "auto":
            raise ValueError("zenflow.select_strategy \"auto\" sets select_interval to 1 epoch; DeepSpeed refuses a "
                             "number with it: remove select_interval or choose \"step\" or \"epoch\"")
        if self.select_strategy != "auto" and self.select_interval == "auto":
            raise ValueError(f"zenflow.select_strategy \"{self.select_strategy}\" needs select_interval as a number")
        return self


class ZeroConfig(Section):
    """ZeRO stage and its bucket, prefetch and persistence sizes (in elements, not bytes)."""

    stage: Int = 0
    overlap_comm: Bool | None = Field(None, json_schema_extra={"default_doc": "true for stage 3, else false"})
    contiguous_gradients: Bool = True
    reduce_scatter: Bool = True
    reduce_bucket_size: Int = 500_000_000
    allgather_partitions: Bool = True
    allgather_bucket_size: Int = 500_000_000
    stage3_prefetch_bucket_size: Int = Field(50_000_000, ge=0)
    stage3_param_persistence_threshold: Int = Field(100_000, ge=0)
    stage3_max_live_parameters: Int = Field(1_000_000_000, ge=0)
    stage3_max_reuse_distance: Int = Field(1_000_000_000, ge=0)
    # > 0: modules this fine are gathered whole, as DeepSpeed chooses them (runtime/zero/leaf_modules.py)
    stage3_module_granularity_threshold: Int = Field(0, ge=0)
    stage3_gather_16bit_weights_on_model_save: Bool = False
    sub_group_size: Int = 1_000_000_000
    # false: a trainable parameter that got no gradient in an accumulation window raises at
    # step(), where DeepSpeed 0.19.8 raises (stages 1-2 with the optimizer offloaded to the CPU)
    ignore_unused_parameters: Bool = True
    mics_shard_size: Int = Field(
        -1, json_schema_extra={"default_doc": "-1 (off: states sharded over the whole data-parallel group)"}
    )
    offload_optimizer: OffloadOptimizerConfig = Field(default_factory=OffloadOptimizerConfig)
    offload_param: OffloadParamConfig = Field(default_factory=OffloadParamConfig)
    # ZeRO++ (C28): quantized weight gathers (qwZ), the secondary partition inside a node
    # (hpZ: 0 and 1 are off, as in DeepSpeed), quantized gradient all-to-alls (qgZ)
    zero_quantized_weights: Bool = False
    zero_hpz_partition_size: Int = Field(1, ge=0)
    zero_quantized_gradients: Bool = False
    zenflow: ZenFlowConfig | None = None
    leaf_module: LeafModuleConfig = Field(default_factory=LeafModuleConfig)

    @field_validator("stage")
    @classmethod
    def _known_stage(cls, stage: int) -> int:
        if stage not in STAGES:
            raise ValueError(f"{stage} is not a ZeRO stage: use 0, 1, 2 or 3")
        return stage

    @field_validator("mics_shard_size")
    @classmethod
    def _shard_size(cls, size: int) -> int:
        if size != -1 and size < 1:
            raise ValueError(f"{size} is not a shard-group size: use a positive number of ranks, or -1 for off")
        return size

    @field_validator("sub_group_size")
    @classmethod
    def _sub_group_elements(cls, size: int) -> int:
        """0 is DeepSpeed's one parameter per sub-group (axolotl's ZeRO configs set it),
        honoured as one sub-group per flat unit's piece (runtime/zero/shard_store.py)."""
        if size < 0:
            raise ValueError(f"sub_group_size {size} is not a number of elements: the optimizer steps (and offload "
                             "pages) that many at once; use a positive size, or 0 for one parameter at a time")
        return size

    @field_validator("reduce_bucket_size")
    @classmethod
    def _positive_bucket(cls, size: int) -> int:
        if size <= 0:
            raise ValueError(f"bucket size {size} must be a positive number of elements (DeepSpeed 0.19.8 refuses "
                             "it too: \"Input should be greater than 0\")")
        return size

    @field_validator("allgather_bucket_size")
    @classmethod
    def _non_negative_gather_bucket(cls, size: int) -> int:
        """0 is accepted as DeepSpeed 0.19.8 accepts it: its all-gather ignores the size (one
        `all_gather_into_tensor` per group), and shardwise reads 0 as no bound."""
        if size < 0:
            raise ValueError(f"bucket size {size} must be a number of elements, or 0 for no bound")
        return size

    @model_validator(mode="after")
    def _resolve_overlap_comm(self) -> "ZeroConfig":
        """DeepSpeed leaves overlap_comm unset so that only stage 3 overlaps by default."""
        if self.overlap_comm is None:
            self.overlap_comm = partitions_parameters(self.stage)
        return self


class OptimizerConfig(Section):
    """An optimizer built from the config: `type` a registered optimizer's name
    (shardwise/runtime/optim/registry.py); `params` holds every key it accepts, defaults filled in."""

    type: str
    params: dict[str, Any] = Field(default_factory=dict)

    @field_validator("type")
    @classmethod
    def _registered(cls, type_name: str) -> str:
        optimizer_spec(type_name)  # raises, naming the registered optimizers
        return type_name

    @property
    def torch_class_name(self) -> str:
        """The `torch.optim` class to build: DeepSpeed's Adam decouples weight decay unless told not to."""
        return torch_class_name(self.type, self.params)

    def torch_kwargs(self) -> dict[str, Any]:
        """`params` minus the keys that select the class rather than configure it."""
        return constructor_kwargs(self.params)


class SchedulerConfig(Section):
    """A learning-rate schedule stepped once per optimizer step: one of DeepSpeed's
    (runtime/optim/schedulers.py), or a `torch.optim.lr_scheduler` class by its exact name
    (runtime/optim/torch_by_name.py), as DeepSpeed 0.19.8 builds one."""

    type: str
    params: dict[str, Any] = Field(default_factory=dict)

    @field_validator("type")
    @classmethod
    def _known(cls, type_name: str) -> str:
        if type_name not in SCHEDULERS and torch_scheduler_class(type_name) is None:
            raise ValueError(f"no schedule {type_name!r}: use one of {', '.join(SCHEDULERS)}, or a "
                             "torch.optim.lr_scheduler class by its exact name")
        return type_name


class ActivationCheckpointingConfig(Section):
    """DeepSpeed's activation-checkpointing switches, plus shardwise's `policy` (which layers
    are recomputed: none / full / every_k with `every_k` / selective / sqrt, see
    shardwise/runtime/activation/policy.py). DeepSpeed's switches say where checkpoints live (Pa,
    CPU, contiguous buffer); without a policy they only configure deepspeed.checkpointing."""

    partition_activations: Bool = False
    cpu_checkpointing: Bool = False
    contiguous_memory_optimization: Bool = False
    number_checkpoints: Int | None = Field(None, ge=1)
    synchronize_checkpoint_boundary: Bool = False
    profile: Bool = False
    policy: Literal["none", "full", "every_k", "selective", "sqrt"] = "none"
    every_k: Int = Field(2, ge=1)

    @field_validator("number_checkpoints", mode="before")
    @classmethod
    def _false_is_no_count(cls, count: Any) -> Any:
        """Public configs write `false` here beside this block's other switches, all false
        (IDEA-Research's hana); DeepSpeed 0.19.8 accepts it, as a count of none: not given.
        `true` stays refused (no count)."""
        return None if count is False else count


class AioConfig(Section):
    """Asynchronous NVMe I/O for ZeRO-Infinity; absent unless the config has an `aio` block."""

    block_size: Int = Field(1_048_576, ge=1)
    queue_depth: Int = Field(8, ge=1)
    thread_count: Int = Field(1, ge=1)
    single_submit: Bool = False
    overlap_events: Bool = True


class TensorParallelConfig(Section):
    """shardwise addition: size of the tensor-parallel group. `sequence_parallel` is
    Megatron's flag (the same as sequence_parallel.mode "megatron"); `plan` maps module-name
    patterns to styles for architectures without a built-in plan (parallel/tensor/styles.py)."""

    size: Int = Field(1, ge=1)
    sequence_parallel: Bool = False
    plan: dict[str, str] | None = None


class ExpertParallelConfig(Section):
    """DeepSpeed's AutoEP block: with `enabled`, a model whose plan spreads its experts (a
    Hugging Face Mixtral's stacked experts, models/hf/experts.py) splits each MoE layer's
    experts over `autoep_size` ranks of every data-parallel group, tokens exchanged by
    all-to-all. DeepSpeed's `MoE(ep_size=...)` layers carry their own size instead. The
    block's other DeepSpeed keys (presets, patterns, kernels) are not provided."""

    enabled: Bool = False
    autoep_size: Int = Field(1, ge=1)


class SequenceParallelConfig(Section):
    """shardwise addition. `size` matters to Ulysses (Megatron-style SP reuses the TP group),
    hence Ulysses is the default mode."""

    size: Int = Field(1, ge=1)
    mode: Literal["megatron", "ulysses"] = "ulysses"


class PipelineParallelConfig(Section):
    """shardwise addition. A pipeline step runs one micro-batch per accumulation step,
    as in DeepSpeed, so `micro_batches` defaults to gradient_accumulation_steps.
    `virtual_stages` chunks per rank are for the interleaved schedule; layers are split
    by `partition` (balanced by parameter count, by forward + backward time measured on a
    synthetic micro-batch of `profile_seq_len` tokens, or uniform) unless `split_points`
    gives the first layer index of every stage after the first."""

    size: Int = Field(1, ge=1)
    schedule: Literal["gpipe", "1f1b", "interleaved"] = "1f1b"
    micro_batches: Int | None = Field(None, ge=1, json_schema_extra={"default_doc": "gradient_accumulation_steps"})
    virtual_stages: Int = Field(1, ge=1)
    partition: Literal["parameters", "uniform", "time"] = "parameters"
    split_points: list[Int] | None = None
    profile_seq_len: Int = Field(512, ge=1)


class TopologyConfig(Section):
    """shardwise addition: how many ranks share a node (ZeRO++'s hierarchy, the count of
    bytes between nodes); null takes the launcher's LOCAL_WORLD_SIZE. Set it to simulate
    nodes on one machine, or where a launcher does not say."""

    ranks_per_node: Int | None = Field(None, ge=1, json_schema_extra={"default_doc": "LOCAL_WORLD_SIZE"})


class CheckpointWriterConfig(Section):
    """DeepSpeed 0.19.8's `checkpoint.writer` (runtime/model_checkpointing/config.py): the
    present block switches DeepSpeed to its fast checkpoint engine, and `decoupled` true to
    its DecoupledCheckpointEngine, which writes in the background while training goes on.
    shardwise's equivalent is its asynchronous save (runtime/checkpoint/policy.py): the
    state is copied to host memory and a background thread writes and publishes it. The
    block's other keys tune DeepSpeed's own file writers (deepspeed_keys.py)."""

    decoupled: Bool = Field(False, description="save checkpoints in the background (shardwise's asynchronous save)")


class CheckpointConfig(Section):
    """DeepSpeed's `checkpoint` block. `tag_validation` (Ignore / Warn / Fail) is read by
    the DeepSpeed API's save and load (api/runtime/engine/checkpoint_arguments.py); the keys of DeepSpeed's
    own checkpoint engines are classified in deepspeed_keys.py."""

    tag_validation: Literal["IGNORE", "WARN", "FAIL"] = "WARN"
    writer: CheckpointWriterConfig | None = None

    @field_validator("tag_validation", mode="before")
    @classmethod
    def _upper_case(cls, mode: Any) -> Any:
        """DeepSpeed upper-cases the mode before checking it (Warn, warn and WARN are one)."""
        return mode.upper() if isinstance(mode, str) else mode


class FlopsProfilerConfig(Section):
    """DeepSpeed's `flops_profiler` block: the engine `deepspeed.initialize` returns profiles
    the forwards of optimizer step `profile_step` on rank 0 and prints DeepSpeed's profile
    (api/profiling/flops_profiler/), as DeepSpeed's engine does. `recompute_fwd_factor` only
    enters the backward lines DeepSpeed prints with wall_clock_breakdown, which shardwise
    does not print."""

    enabled: Bool = False
    recompute_fwd_factor: Float = 0.0
    profile_step: Int = Field(1, ge=0, description="the optimizer step (counted from 0) whose forwards are profiled")
    module_depth: Int = Field(-1, ge=-1, description="the depths the aggregated profile lists (-1: all)")
    top_modules: Int = Field(1, ge=0, description="the module types the aggregated profile lists per depth")
    detailed: Bool = Field(True, description="also print the model with each module's numbers")
    output_file: str | None = Field(None, description="write the profile to this file instead of stdout")


class TensorBoardConfig(Section):
    """TensorBoard event files, written under output_path/job_name by rank 0 after every
    optimizer step (frontends/deepspeed/monitors/)."""

    enabled: Bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


class CsvMonitorConfig(Section):
    """DeepSpeed's CSV monitor: one `<series>.csv` per series (step, value) under output_path/job_name."""

    enabled: Bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


class WandbConfig(Section):
    """Weights & Biases: `wandb.init(project, group, entity=team)` on rank 0; WANDB_MODE=offline
    writes the run under ./wandb without a network."""

    enabled: Bool = False
    group: str | None = None
    team: str | None = None
    project: str = "deepspeed"


class CometConfig(Section):
    """Comet: an experiment on rank 0 (`online` false: an offline experiment written to disk),
    logged every `samples_log_interval` samples; the keys are DeepSpeed's."""

    enabled: Bool = False
    samples_log_interval: Int = Field(100, ge=1)
    project: str | None = None
    workspace: str | None = None
    api_key: str | None = None
    experiment_name: str | None = None
    experiment_key: str | None = None
    online: Bool | None = None
    mode: Literal["get", "create", "get_or_create"] | None = None


class CompileConfig(Section):
    """shardwise addition: `torch.compile` per block, in the kernel and compile step of a model's `parallelize`.
    Also reads DeepSpeed's spelling of the block (runtime/compiler.py): `kwargs` passed to
    `torch.compile`, and DeepCompile's `deepcompile` and `passes`: DeepSpeed compiles the
    model with its ZeRO as graph passes ("z1", "z3"); shardwise runs ZeRO at run time, so
    `deepcompile` true means torch.compile per block beside it (as `enabled`), and passes
    "z1"/"z3" are what zero_optimization.stage already does. `fused_ops`
    swaps in shardwise.runtime.ops' fused kernels (norms, bias+GeLU, SwiGLU, linear+cross-entropy)."""

    enabled: Bool = False
    mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] | None = None
    backend: str = "inductor"
    kwargs: dict[str, Any] = Field(default_factory=dict)
    fused_ops: Bool = False
    deepcompile: Bool = False
    passes: list[Literal["z1", "z3", "autosp", "autotp"]] | None = None

    @field_validator("passes")
    @classmethod
    def _zero_passes_only(cls, passes: list[str] | None) -> list[str] | None:
        parallel = {"autosp": "sequence_parallel (mode 'ulysses', size)", "autotp": "tensor_parallel.size"}
        asked = [name for name in passes or [] if name in parallel]
        if asked:
            raise ValueError(f"{asked}: DeepCompile's automatic parallelism passes are not graph passes in "
                             f"shardwise; set {' and '.join(parallel[name] for name in asked)} instead")
        return passes

    @property
    def compiles(self) -> bool:
        """torch.compile per block: asked for by `enabled`, or by DeepCompile's `deepcompile`."""
        return self.enabled or self.deepcompile

    @model_validator(mode="after")
    def _known_kwargs(self) -> "CompileConfig":
        allowed = {"fullgraph", "dynamic", "mode", "options", "disable"}
        unknown = sorted(set(self.kwargs) - allowed)
        if unknown:
            raise ValueError(f"compile.kwargs {unknown} are not torch.compile arguments shardwise passes on "
                             f"(accepted: {sorted(allowed)}; the backend is compile.backend)")
        if "mode" in self.kwargs and self.mode is not None and self.kwargs["mode"] != self.mode:
            raise ValueError(f"compile.mode {self.mode!r} and compile.kwargs.mode {self.kwargs['mode']!r} differ: keep one")
        return self


# The keys DeepSpeed's runtime/config.py reads for each sparse_attention mode, plus `attention`
# for bigbird and bslongformer, whose layout classes take it though DeepSpeed's reader drops it.
SPARSE_ATTENTION_KEYS: dict[str, frozenset[str]] = {
    "dense": frozenset({"block"}),
    "fixed": frozenset({"block", "different_layout_per_head", "num_local_blocks", "num_global_blocks", "attention",
                        "horizontal_global_attention", "num_different_global_patterns"}),
    "variable": frozenset({"block", "different_layout_per_head", "num_random_blocks", "local_window_blocks",
                           "global_block_indices", "global_block_end_indices", "attention",
                           "horizontal_global_attention"}),
    "bigbird": frozenset({"block", "different_layout_per_head", "num_random_blocks", "num_sliding_window_blocks",
                          "num_global_blocks", "attention"}),
    "bslongformer": frozenset({"block", "different_layout_per_head", "num_sliding_window_blocks",
                               "global_block_indices", "global_block_end_indices", "attention"}),
}


class SparseAttentionConfig(Section):
    """DeepSpeed's `sparse_attention` block: a block-sparse layout for every attention
    layer (shardwise.runtime.ops.sparse_attention), defaults from DeepSpeed's runtime/constants.py.
    DeepSpeed ignores the keys a mode does not read; shardwise names them as errors."""

    mode: Literal["dense", "fixed", "variable", "bigbird", "bslongformer"] = "fixed"
    block: Int = Field(16, ge=1)
    different_layout_per_head: Bool = False
    num_local_blocks: Int = Field(4, ge=1)
    num_global_blocks: Int = Field(1, ge=1)
    attention: Literal["unidirectional", "bidirectional"] = "bidirectional"
    horizontal_global_attention: Bool = False
    num_different_global_patterns: Int = Field(1, ge=1)
    num_random_blocks: Int = Field(0, ge=0)
    local_window_blocks: list[Int] = Field(default_factory=lambda: [4])
    global_block_indices: list[Int] = Field(default_factory=lambda: [0])
    global_block_end_indices: list[Int] | None = None
    num_sliding_window_blocks: Int = Field(3, ge=1)

    @model_validator(mode="after")
    def _keys_of_the_mode(self) -> "SparseAttentionConfig":
        unused = sorted(self.model_fields_set - SPARSE_ATTENTION_KEYS[self.mode] - {"mode"})
        if unused:
            raise ValueError(f"sparse_attention.mode {self.mode!r} does not use {unused} (DeepSpeed ignores them): "
                             f"remove them; this mode reads {sorted(SPARSE_ATTENTION_KEYS[self.mode])}")
        # The layout class's own checks, reported with the config's other problems; imported
        # here so that torch loads only for configs with a sparse_attention block.
        from shardwise.frontends.deepspeed.config.sparse_attention import sparsity_config

        sparsity_config(self, num_heads=1)
        return self


_COMMUNICATION_DTYPES = {
    "fp32": "fp32", "float32": "fp32",
    "fp16": "fp16", "float16": "fp16",
    "bf16": "bf16", "bfloat16": "bf16", "bfp16": "bf16",
}


class ReplicaCheckConfig(Section):
    """shardwise addition: every `interval` optimizer steps, and before each checkpoint is
    saved, the data-parallel replicas compare a checksum of their weights and stop with an
    error naming the first parameter and the ranks that differ (0: off). Stages 0-2, where
    every replica holds whole parameters (shardwise/runtime/reliability/replica_check.py)."""

    interval: Int = Field(0, ge=0)


class AutoResumeConfig(Section):
    """shardwise addition, for elastic jobs (docs/launching.md#elastic-training): every
    engine built loads the newest checkpoint in `checkpoint_dir`, if any, at the world size
    it is built at (runtime/checkpoint/auto_resume.py). The global batch is kept across
    sizes: `gradient_accumulation_steps` is derived again from `train_batch_size` and the
    micro-batch, and, with `adjust_micro_batch`, the micro-batch is lowered to the largest
    size that divides the global batch among the ranks when it does not."""

    checkpoint_dir: str | None = None
    adjust_micro_batch: Bool = False


class ModelInfoConfig(Section):
    """DeepSpeed's `autotuning.model_info`: the model's size, which its autotuner reads to
    bound the micro-batch. `shardwise tune` prices plans from it (with `--heads`,
    `--seq-len` and `--vocab-size`, which the time model also needs). `profile` true asks
    DeepSpeed to run the model once to measure it; shardwise does not, so it is refused."""

    profile: Bool = False
    num_params: Int | None = Field(None, ge=1)
    hidden_size: Int | None = Field(None, ge=1)
    num_layers: Int | None = Field(None, ge=1)

    @field_validator("profile")
    @classmethod
    def _no_profile_run(cls, profile: bool) -> bool:
        if profile:
            raise ValueError("shardwise tune does not run a model-profiling experiment first: give num_params, "
                             "hidden_size and num_layers (or `shardwise tune --preset`/`--hf-config`) and set "
                             "profile false")
        return profile


class AutotuningConfig(Section):
    """DeepSpeed's `autotuning` block as DeepSpeed 0.19.8 reads it (autotuning/config.py,
    constants.py), with its defaults. `shardwise tune` reads the search settings; with
    `enabled` the engine measures steps start_profile_step..end_profile_step (0-based, as
    DeepSpeed counts them), writes the metrics to `metric_path` and exits, as DeepSpeed's
    engine does under its autotuner (runtime/engine/trial.py). DeepSpeed silently ignores
    keys it does not know; shardwise refuses them, its own documentation's `start_step` and
    `end_step` included (DeepSpeed never reads them, so they would profile steps 3..5)."""

    enabled: Bool = False
    fast: Bool = True
    results_dir: str = Field("autotuning_results", min_length=1)
    exps_dir: str = Field("autotuning_exps", min_length=1)
    overwrite: Bool = True
    start_profile_step: Int = Field(3, ge=0)
    end_profile_step: Int = Field(5, ge=0)
    metric: Literal["latency", "throughput", "flops"] = "throughput"
    metric_path: str | None = None
    tuner_type: Literal["gridsearch", "random", "model_based"] = "gridsearch"
    tuner_early_stopping: Int = Field(5, ge=1)
    tuner_num_trials: Int = Field(50, ge=1)
    arg_mappings: dict[str, str] | None = None
    max_train_batch_size: Int | None = Field(None, ge=1)
    min_train_batch_size: Int = Field(1, ge=1)
    max_train_micro_batch_size_per_gpu: Int = Field(1024, ge=1)
    min_train_micro_batch_size_per_gpu: Int = Field(1, ge=1)
    num_tuning_micro_batch_sizes: Int = Field(3, ge=1)
    mp_size: Int = Field(1, ge=1)
    model_info: ModelInfoConfig | None = None
    model_info_path: str | None = None

    @model_validator(mode="after")
    def _ordered(self) -> "AutotuningConfig":
        if self.end_profile_step < self.start_profile_step:
            raise ValueError(f"end_profile_step {self.end_profile_step} is before start_profile_step "
                             f"{self.start_profile_step}: the steps measured are start..end, inclusive")
        if self.max_train_micro_batch_size_per_gpu < self.min_train_micro_batch_size_per_gpu:
            raise ValueError(f"max_train_micro_batch_size_per_gpu {self.max_train_micro_batch_size_per_gpu} is "
                             f"below min_train_micro_batch_size_per_gpu {self.min_train_micro_batch_size_per_gpu}")
        return self


class ShardwiseConfig(Section):
    """A whole training config with DeepSpeed's key names, every value resolved."""

    train_batch_size: Int = Field(
        ge=1,
        json_schema_extra={
            "default_doc": "train_micro_batch_size_per_gpu x gradient_accumulation_steps x data-parallel size"
        },
    )
    train_micro_batch_size_per_gpu: Int = Field(
        ge=1,
        json_schema_extra={"default_doc": "train_batch_size / (gradient_accumulation_steps x data-parallel size)"},
    )
    gradient_accumulation_steps: Int = Field(
        ge=1,
        json_schema_extra={
            "default_doc": "1, or train_batch_size / (train_micro_batch_size_per_gpu x data-parallel size)"
        },
    )
    gradient_allreduce_op: Literal["mean", "sum"] = Field(
        "mean", description="how gradients combine over the data-parallel ranks: their mean, or (DeepSpeed's "
        "\"sum\") their sum, N times the mean over N ranks"
    )
    gradient_clipping: Float = Field(0.0, description="the maximum gradient norm; 0 or a negative value: no "
                                     "clipping (DeepSpeed 0.19.8 clips only above 0)")
    managed_gradient_accumulation: Bool = Field(
        True, description="true: the engine counts gradient_accumulation_steps micro-batches per update; false: "
        "every step() ends the window, so the caller decides how many backward passes one update sums (each loss "
        "still divided by gradient_accumulation_steps unless backward gets scale_wrt_gas=False), as in DeepSpeed "
        "0.19.8")
    max_consecutive_skipped_steps: Int = Field(
        3,
        ge=0,
        description="shardwise addition: stop with an error after this many consecutive optimizer "
        "steps skipped for non-finite gradients that loss scaling cannot explain",
    )
    replica_check: ReplicaCheckConfig = Field(default_factory=ReplicaCheckConfig)
    auto_resume: AutoResumeConfig = Field(default_factory=AutoResumeConfig)
    steps_per_print: Int | None = Field(10, description="report progress every this many optimizer steps; null: "
                                        "never; a negative value: every step, as DeepSpeed 0.19.8 does")
    dataloader_drop_last: Bool = Field(
        False, description="the data loader built by deepspeed.initialize(training_data=...) drops the last, "
        "incomplete micro-batch (and the sampler the samples that do not divide among the ranks)"
    )
    seed: Int | None = Field(None, ge=0)
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    fp16: Fp16Config = Field(default_factory=Fp16Config)
    bf16: Bf16Config = Field(default_factory=Bf16Config)
    communication_data_type: Literal["fp32", "fp16", "bf16"] | None = Field(
        None, json_schema_extra={"default_doc": "the gradients' dtype"}
    )
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    activation_checkpointing: ActivationCheckpointingConfig = Field(default_factory=ActivationCheckpointingConfig)
    aio: AioConfig | None = None
    tensor_parallel: TensorParallelConfig = Field(default_factory=TensorParallelConfig)
    expert_parallel: ExpertParallelConfig = Field(default_factory=ExpertParallelConfig)
    use_data_before_expert_parallelism: Bool = False
    sequence_parallel: SequenceParallelConfig = Field(default_factory=SequenceParallelConfig)
    pipeline_parallel: PipelineParallelConfig = Field(default_factory=PipelineParallelConfig)
    topology: TopologyConfig = Field(default_factory=TopologyConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig)
    csv_monitor: CsvMonitorConfig = Field(default_factory=CsvMonitorConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    comet: CometConfig = Field(default_factory=CometConfig)
    flops_profiler: FlopsProfilerConfig = Field(default_factory=FlopsProfilerConfig)
    torch_autocast: TorchAutocastConfig = Field(default_factory=TorchAutocastConfig)
    data_types: DataTypesConfig = Field(default_factory=DataTypesConfig)
    compile: CompileConfig = Field(default_factory=CompileConfig)
    sparse_attention: SparseAttentionConfig | None = None
    data_efficiency: DataEfficiencyConfig = Field(default_factory=DataEfficiencyConfig)
    autotuning: AutotuningConfig = Field(default_factory=AutotuningConfig)

    @field_validator("gradient_clipping", mode="before")
    @classmethod
    def _finite_clipping(cls, max_norm: Any) -> Any:
        """A NaN norm silently switches clipping off (every comparison with NaN is false) and
        Infinity does the same under another name; 0 is the one spelling of "no clipping"."""
        if isinstance(max_norm, float) and not math.isfinite(max_norm):
            raise ValueError(
                f"{max_norm} is not a finite gradient norm: give a maximum norm such as 1.0, or 0 to disable clipping"
            )
        return max_norm

    @field_validator("gradient_allreduce_op", mode="before")
    @classmethod
    def _lower_case_op(cls, op: Any) -> Any:
        """DeepSpeed 0.19.8 reads the operation in any letter case."""
        return op.lower() if isinstance(op, str) else op

    @field_validator("steps_per_print", mode="before")
    @classmethod
    def _infinity_is_never(cls, interval: Any) -> Any:
        """Infinity, which Accelerate writes to silence DeepSpeed's progress lines (DeepSpeed
        reads it as never), is the largest step count; other non-finite numbers stay refused."""
        return sys.maxsize if interval == math.inf else interval

    @field_validator("steps_per_print")
    @classmethod
    def _nonzero_print_interval(cls, interval: int | None) -> int | None:
        """DeepSpeed 0.19.8 accepts 0 and then divides by it at the first step."""
        if interval == 0:
            raise ValueError("0 is no interval (DeepSpeed 0.19.8 accepts it, then fails at the first step with "
                             "\"integer modulo by zero\"): give a number of steps, or null to print nothing")
        return interval

    @field_validator("communication_data_type", mode="before")
    @classmethod
    def _normalise_dtype(cls, name: Any) -> Any:
        if not isinstance(name, str):
            return name
        if name.lower() not in _COMMUNICATION_DTYPES:
            raise ValueError(f"{name!r} is not a communication data type: use fp32, fp16 or bf16")
        return _COMMUNICATION_DTYPES[name.lower()]

    @model_validator(mode="after")
    def _resolve_micro_batches(self) -> "ShardwiseConfig":
        if self.pipeline_parallel.micro_batches is None:
            self.pipeline_parallel.micro_batches = self.gradient_accumulation_steps
        return self

    # Read as a mapping, the config answers as written: DeepSpeed's `engine.config` is the
    # dict the script passed, and integrations read it so (the Hugging Face Trainer's
    # `save_model` takes the ZeRO stage from `engine.config.get("zero_optimization", {})`).
    _written: dict[str, Any] = PrivateAttr(default_factory=dict)

    def remember_written(self, written: dict[str, Any]) -> None:
        """The config as the script passed it (deepspeed.initialize)."""
        self._written = written

    def get(self, key: str, default: Any = None) -> Any:
        return self._written.get(key, default)

    def __getitem__(self, key: str) -> Any:
        return self._written[key]

    def __contains__(self, key: object) -> bool:
        return key in self._written
