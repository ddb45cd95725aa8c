"""A resolved DeepSpeed config as the runtime's policies: the one place where config keys
become typed settings (shardwise/runtime/engine/policies.py).

Everything the config says was validated and filled by `load_config`; here each block
maps onto its policy, with DeepSpeed's meaning: `fp16.loss_scale` 0 is dynamic scaling from
2**initial_scale_power, `communication_data_type` is the gradients' wire dtype,
`zero_optimization.mics_shard_size` is hybrid sharding, `sequence_parallel.mode` "megatron"
is tensor parallelism's own sequence split, `pipeline_parallel.micro_batches` defaults to
the accumulation steps, `torch_autocast` is the forward under autocast from fp32 parameters
(or bf16 ones beside bf16),
`bf16.bf16_master_weights_and_grads` is bf16 masters (the partition trained in place),
`zero_optimization.offload_param` applies at stage 3 only (DeepSpeed ignores it below),
`compile.deepcompile` is torch.compile per block beside the run-time ZeRO,
`data_types.grad_accum_dtype` fp32 is ZeRO's fp32 gradient accumulation,
`checkpoint.writer.decoupled` is the asynchronous checkpoint save.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from shardwise.formulas.stages import partitions_optimizer, partitions_parameters
from shardwise.frontends.deepspeed.config.data_efficiency import data_sampling_policy
from shardwise.frontends.deepspeed.config.deepspeed_keys import DATA_TYPE_NAMES
from shardwise.frontends.deepspeed.config.schema import OffloadConfig, ShardwiseConfig, ZenFlowConfig, ZeroConfig
from shardwise.frontends.deepspeed.config.random_ltd import random_ltd_policy
from shardwise.frontends.deepspeed.config.sparse_attention import SparseLayout
from shardwise.runtime.activation.policy import ActivationPolicy, RecomputePolicy
from shardwise.runtime.checkpoint.policy import CheckpointPolicy
from shardwise.runtime.compile.policy import CompilePolicy
from shardwise.runtime.distributed.topology import TopologyPolicy
from shardwise.runtime.engine.policies import OptimizerPolicy, Policies, SchedulerPolicy, TrainingPolicy
from shardwise.runtime.engine.trial import TrialPolicy
from shardwise.runtime.ops.policy import KernelPolicy
from shardwise.runtime.optim.registry import optimizer_spec
from shardwise.runtime.parallel.expert.policy import ExpertPolicy
from shardwise.runtime.parallel.pipeline.policy import PipelinePolicy
from shardwise.runtime.parallel.sequence.policy import SequencePolicy
from shardwise.runtime.parallel.tensor.policy import TensorPolicy
from shardwise.runtime.precision.policy import LossScalingPolicy, PrecisionPolicy
from shardwise.runtime.zero.leaf_modules import LeafModulePolicy
from shardwise.runtime.zero.policy import (
    OffloadPolicy,
    PrefetchPolicy,
    ZenFlowPolicy,
    ZeroPlusPlusPolicy,
    ZeroPolicy,
)

log = logging.getLogger("shardwise")

# allgather_bucket_size 0: one all-gather of the whole partition (schema.py)
UNBOUNDED_BUCKET = 2**62

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# torch_autocast.dtype's spellings (DeepSpeed's DtypeEnum).
AUTOCAST_DTYPES = {spelling: DTYPES[name] for spelling, name in DATA_TYPE_NAMES.items()}


def policies_from_config(cfg: ShardwiseConfig, *, sequence_sharded_by_caller: bool = False) -> Policies:
    """The runtime's policies for `cfg`. `sequence_sharded_by_caller`: the script runs
    Ulysses itself (DeepSpeed's ALST, `deepspeed.initialize(mpu=...)`; SequencePolicy)."""
    return Policies(
        zero=zero_policy(cfg),
        precision=precision_policy(cfg),
        training=TrainingPolicy(cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps,
                                max(cfg.gradient_clipping, 0.0), cfg.max_consecutive_skipped_steps,
                                cfg.replica_check.interval,
                                caller_ends_windows=not cfg.managed_gradient_accumulation),
        tensor=TensorPolicy(cfg.tensor_parallel.size,
                            cfg.tensor_parallel.sequence_parallel or cfg.sequence_parallel.mode == "megatron"),
        sequence=SequencePolicy(cfg.sequence_parallel.size, sharded_by_caller=sequence_sharded_by_caller),
        pipeline=pipeline_policy(cfg),
        expert=ExpertPolicy(cfg.expert_parallel.autoep_size if cfg.expert_parallel.enabled else 1,
                            data_before_expert=cfg.use_data_before_expert_parallelism),
        activation=activation_policy(cfg),
        compile=compile_policy(cfg),
        kernels=KernelPolicy(cfg.compile.fused_ops,
                             SparseLayout.from_section(cfg.sparse_attention) if cfg.sparse_attention else None,
                             cfg.seed or 0),
        topology=TopologyPolicy(cfg.topology.ranks_per_node),
        checkpoint=CheckpointPolicy(asynchronous=cfg.checkpoint.writer is not None and cfg.checkpoint.writer.decoupled,
                                    resume_from=cfg.auto_resume.checkpoint_dir),
        optimizer=OptimizerPolicy(cfg.optimizer.type, dict(cfg.optimizer.params)) if cfg.optimizer else None,
        scheduler=SchedulerPolicy(cfg.scheduler.type, dict(cfg.scheduler.params)) if cfg.scheduler else None,
        data_sampling=data_sampling_policy(cfg.data_efficiency),
        random_ltd=random_ltd_policy(cfg.data_efficiency.data_routing, seed=cfg.data_efficiency.seed,
                                     global_batch_size=cfg.train_batch_size),
        trial=trial_policy(cfg),
    )


def trial_policy(cfg: ShardwiseConfig) -> TrialPolicy | None:
    """`autotuning.enabled`: this run is one trial of an autotuner. The metrics go to
    `metric_path`, by default ./autotuning_metric.json as DeepSpeed's engine writes it."""
    block = cfg.autotuning
    if not block.enabled:
        return None
    path = block.metric_path or str(Path.cwd() / "autotuning_metric.json")
    return TrialPolicy(path, block.start_profile_step, block.end_profile_step, cfg.train_batch_size)


def zero_policy(cfg: ShardwiseConfig) -> ZeroPolicy:
    zero = cfg.zero_optimization
    return ZeroPolicy(
        stage=zero.stage,
        reduce_bucket_size=zero.reduce_bucket_size,
        allgather_bucket_size=zero.allgather_bucket_size or UNBOUNDED_BUCKET,
        overlap_comm=bool(zero.overlap_comm),
        reduce_scatter=zero.reduce_scatter,
        sub_group_size=zero.sub_group_size,
        refuse_unused_parameters=refuses_unused_parameters(zero),
        sum_gradients=cfg.gradient_allreduce_op == "sum",
        prefetch=PrefetchPolicy(zero.stage3_prefetch_bucket_size, zero.stage3_max_live_parameters,
                                zero.stage3_max_reuse_distance, zero.stage3_param_persistence_threshold),
        # stage 0 offloads nothing (find_ignored says so): the whole state stays on every rank
        offload_optimizer=offload_policy(zero.offload_optimizer, cfg) if partitions_optimizer(zero.stage)
        else OffloadPolicy(),
        offload_param=offload_policy(zero.offload_param, cfg) if partitions_parameters(zero.stage) else OffloadPolicy(),
        shard_size=zero.mics_shard_size if zero.mics_shard_size > 0 else None,
        gather_16bit_weights_on_save=zero.stage3_gather_16bit_weights_on_model_save,
        zenflow=zenflow_policy(zero.zenflow) if zero.zenflow is not None else None,
        plus_plus=plus_plus_policy(cfg),
        leaf_modules=LeafModulePolicy(tuple(dict.fromkeys(zero.leaf_module.classes)),
                                      tuple(dict.fromkeys(zero.leaf_module.names)),
                                      tuple(dict.fromkeys(zero.leaf_module.name_suffixes)),
                                      zero.stage3_module_granularity_threshold),
    )


def refuses_unused_parameters(zero: ZeroConfig) -> bool:
    """`ignore_unused_parameters: false` as DeepSpeed 0.19.8 enforces it: only its stage 1-2
    optimizer with the optimizer offloaded to the CPU checks (when it sums the gradient
    norm on the host); elsewhere a parameter without a gradient counts as a zero gradient."""
    return (not zero.ignore_unused_parameters and zero.stage in (1, 2)
            and zero.offload_optimizer.device == "cpu")


def plus_plus_policy(cfg: ShardwiseConfig) -> ZeroPlusPlusPolicy:
    """ZeRO++'s three keys; DeepSpeed reads them at stage 3 only and ignores them below,
    and so does shardwise, with a warning (they would not do what they say)."""
    zero = cfg.zero_optimization
    policy = ZeroPlusPlusPolicy(quantized_weights=zero.zero_quantized_weights,
                                hpz_partition_size=max(zero.zero_hpz_partition_size, 1),
                                quantized_gradients=zero.zero_quantized_gradients)
    if policy.enabled and not partitions_parameters(zero.stage):
        log.warning("shardwise: zero_optimization.zero_quantized_weights, zero_hpz_partition_size and "
                    "zero_quantized_gradients (ZeRO++) act on stage 3 only; at stage %d they are ignored, as "
                    "DeepSpeed ignores them", zero.stage)
        return ZeroPlusPlusPolicy()
    return policy


def zenflow_policy(section: ZenFlowConfig) -> ZenFlowPolicy:
    """DeepSpeed's reading (runtime/zenflow/engine.py): "auto" selects every epoch; an
    epoch interval counts the batches of the training data given to `initialize` (the
    engine learns them then), and without it columns are chosen once, after warm-up."""
    step = section.select_strategy == "step"
    epochs = 1 if section.select_strategy == "auto" else section.select_interval
    return ZenFlowPolicy(topk_ratio=section.topk_ratio, update_interval=section.update_interval,
                         select_interval_steps=section.select_interval if step else 0,
                         select_interval_epochs=0 if step else epochs, full_warm_up_rounds=section.full_warm_up_rounds,
                         overlap_step=section.overlap_step)


def offload_policy(section: OffloadConfig, cfg: ShardwiseConfig) -> OffloadPolicy:
    """An offload block with the `aio` block's I/O settings and the optimizer's state count."""
    aio, optimizer, defaults = cfg.aio, cfg.optimizer, OffloadPolicy()
    states = optimizer_spec(optimizer.type).fp32_states(optimizer.params) if optimizer is not None else 2
    return OffloadPolicy(
        section.device, section.nvme_path, section.pin_memory, section.buffer_count,
        aio.thread_count if aio else defaults.thread_count, aio.block_size if aio else defaults.block_size, states,
        getattr(section, "ratio", defaults.ratio), getattr(section, "buffer_size", defaults.buffer_size),
        aio.queue_depth if aio else defaults.queue_depth,
    )


def scales_dynamically(cfg: ShardwiseConfig) -> bool:
    """Whether the loss is scaled by DeepSpeed's dynamic scaler: fp16 (or fp16 autocast, as
    DeepSpeed's GradScaler does) with `fp16.loss_scale` 0."""
    autocast = cfg.torch_autocast
    fp16_autocast = autocast.enabled and autocast.dtype is not None and AUTOCAST_DTYPES[autocast.dtype] == torch.float16
    return (cfg.fp16.enabled or fp16_autocast) and cfg.fp16.loss_scale == 0


def precision_policy(cfg: ShardwiseConfig) -> PrecisionPolicy:
    dtype = torch.bfloat16 if cfg.bf16.enabled else torch.float16 if cfg.fp16.enabled else torch.float32
    reduce = DTYPES[cfg.communication_data_type] if cfg.communication_data_type else None
    fp16, autocast = cfg.fp16, cfg.torch_autocast
    autocast_dtype = AUTOCAST_DTYPES[autocast.dtype] if autocast.dtype is not None else None
    scaling = None
    # fp16 (or fp16 autocast, as DeepSpeed's GradScaler does) scales the loss by the fp16 block's settings
    if fp16.enabled or (autocast.enabled and autocast_dtype == torch.float16):
        scaling = (LossScalingPolicy(fp16.loss_scale, dynamic=False) if fp16.loss_scale > 0 else
                   LossScalingPolicy(2.0**fp16.initial_scale_power, True, fp16.loss_scale_window, fp16.hysteresis,
                                     fp16.consecutive_hysteresis, fp16.min_loss_scale))
    master = torch.bfloat16 if cfg.bf16.enabled and cfg.bf16.bf16_master_weights_and_grads else torch.float32
    named = cfg.data_types.grad_accum_dtype
    accumulate = DTYPES[DATA_TYPE_NAMES[named]] if named is not None else dtype
    # DeepSpeed 0.19.8 wraps the optimizer in FP16_Optimizer / FP16_UnfusedOptimizer without
    # ZeRO in fp16 and bf16 (in BF16_Optimizer for a bf16 pipeline), which step it once on zero
    # gradients when built (their initialize_optimizer_states)
    wrapped = (cfg.zero_optimization.stage == 0 and dtype != torch.float32
               and not (dtype == torch.bfloat16 and "pipeline_parallel" in cfg.model_fields_set))
    return PrecisionPolicy(dtype, reduce, scaling, master_dtype=master, autocast=autocast.enabled,
                           autocast_dtype=autocast_dtype, grad_accum_dtype=accumulate if accumulate != dtype else None,
                           initial_zero_gradient_step=wrapped)


def pipeline_policy(cfg: ShardwiseConfig) -> PipelinePolicy:
    pipe = cfg.pipeline_parallel
    return PipelinePolicy(pipe.size, pipe.schedule, pipe.micro_batches or cfg.gradient_accumulation_steps,
                          pipe.virtual_stages, pipe.partition,
                          tuple(pipe.split_points) if pipe.split_points is not None else None, pipe.profile_seq_len)


def activation_policy(cfg: ShardwiseConfig) -> ActivationPolicy:
    block = cfg.activation_checkpointing
    return ActivationPolicy(RecomputePolicy(block.policy, block.every_k), block.partition_activations,
                            block.cpu_checkpointing, block.contiguous_memory_optimization, block.number_checkpoints,
                            block.synchronize_checkpoint_boundary, block.profile)


def compile_policy(cfg: ShardwiseConfig) -> CompilePolicy:
    block = cfg.compile
    return CompilePolicy(block.compiles, block.backend, block.mode, dict(block.kwargs))
