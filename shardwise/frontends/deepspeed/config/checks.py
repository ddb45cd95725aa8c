"""Checks that need the whole validated config: capabilities shardwise has not built yet,
and settings that are each valid but contradict one another.

Blocks for later capabilities are part of the schema so that a DeepSpeed config naming
them with everything switched off loads unchanged; only values that would switch such
a capability on are refused, each with the key that does it.
"""

import torch

from shardwise.formulas.stages import partitions_gradients, partitions_optimizer, partitions_parameters
from shardwise.frontends.deepspeed.config.deepspeed_keys import DATA_TYPE_NAMES
from shardwise.frontends.deepspeed.config.policies import AUTOCAST_DTYPES, compile_policy, scales_dynamically
from shardwise.frontends.deepspeed.config.schema import (
    FP16_MAX_EXPONENT,
    MAX_INITIAL_SCALE_POWER,
    OffloadConfig,
    ShardwiseConfig,
)

# the optimizers that exchange their own compressed momentum (optim/onebit.py), on their own schedule
COMPRESSED_OPTIMIZERS = ("OneBitAdam", "OneBitLamb", "ZeroOneAdam")


def find_unsupported(cfg: ShardwiseConfig) -> list[str]:
    """One line per setting that asks for a capability shardwise does not have yet."""
    problems = []
    bf16 = cfg.bf16
    if bf16.bf16_master_weights_and_grads and not bf16.enabled:
        problems.append("bf16.bf16_master_weights_and_grads needs bf16.enabled true: the masters are kept in bf16 "
                        "beside bf16 parameters")
    return problems


def find_ignored(cfg: ShardwiseConfig) -> list[str]:
    """One line per setting that DeepSpeed 0.19.8 accepts and runs without using, as
    shardwise does (load_config logs them in its one warning)."""
    zero, compile_block = cfg.zero_optimization, cfg.compile
    notes = []
    if zero.offload_param.device != "none" and not partitions_parameters(zero.stage):
        notes.append(f"'zero_optimization.offload_param.device' '{zero.offload_param.device}' at "
                     f"zero_optimization.stage {zero.stage}: only stage 3 partitions (and so offloads) parameters; "
                     "DeepSpeed ignores it below stage 3 too")
    if zero.offload_optimizer.device != "none" and not partitions_optimizer(zero.stage) and zero.zenflow is None:
        notes.append(f"'zero_optimization.offload_optimizer.device' '{zero.offload_optimizer.device}' at "
                     "zero_optimization.stage 0: only stages 1-3 partition (and so offload) the optimizer state, "
                     "so every rank keeps the whole state on the device. DeepSpeed 0.19.8 builds its CPU Adam over "
                     "the parameters where they are, which on a CPU is the same update and on a GPU fails at the "
                     "first step (\"must be 'cpu'\"); use stage 1-3 to offload")
    if compile_block.deepcompile:
        passes = f" and compile.passes {compile_block.passes}" if compile_block.passes else ""
        notes.append(f"'compile.deepcompile' true{passes}: DeepSpeed compiles ZeRO into the graph; shardwise runs "
                     f"zero_optimization.stage {zero.stage} at run time and compiles each block with torch.compile "
                     "(as compile.enabled), the same training")
    return notes


def find_contradictions(
    cfg: ShardwiseConfig, batch_known: bool = True, data_parallel_size: int | None = None
) -> list[str]:
    """One line per pair of settings that cannot both hold, with the values involved.
    `batch_known` False skips the checks against batch sizes that could not be resolved;
    `data_parallel_size` None skips those against the data-parallel size."""
    problems = []
    shard = cfg.zero_optimization.mics_shard_size
    if shard != -1 and not partitions_optimizer(cfg.zero_optimization.stage):
        problems.append(
            f"zero_optimization.mics_shard_size {shard} needs zero_optimization.stage 1, 2 or 3: "
            "stage 0 shards nothing, so there is no shard group to size"
        )
    elif shard != -1 and data_parallel_size is not None and data_parallel_size % shard:
        problems.append(
            f"zero_optimization.mics_shard_size {shard} does not divide the data-parallel size "
            f"{data_parallel_size}: states are replicated over {data_parallel_size} / {shard} groups"
        )
    problems += _offload_contradictions(cfg)
    problems += _dynamic_scaling_contradictions(cfg)
    if cfg.fp16.enabled and cfg.bf16.enabled:
        problems.append("fp16.enabled and bf16.enabled are both true: choose one training precision")
    for name in ("offload_optimizer", "offload_param"):
        offload: OffloadConfig = getattr(cfg.zero_optimization, name)
        if offload.device == "nvme" and not offload.nvme_path:
            problems.append(
                f"zero_optimization.{name}.device is 'nvme' but zero_optimization.{name}.nvme_path is not set"
            )
    problems += _sequence_parallel_contradictions(cfg)
    problems += _zero_plus_plus_contradictions(cfg)
    problems += _zenflow_contradictions(cfg, batch_known)
    problems += _onebit_contradictions(cfg)
    problems += _summed_gradient_contradictions(cfg)
    problems += _activation_contradictions(cfg)
    problems += _pipeline_contradictions(cfg, batch_known)
    problems += _compile_contradictions(cfg)
    problems += _bf16_masters_contradictions(cfg)
    problems += _caller_ended_window_contradictions(cfg)
    if cfg.optimizer is not None and cfg.optimizer.type.lower() == "lamb" and cfg.fp16.loss_scale != 0:
        problems.append(f"optimizer.type 'Lamb' with fp16.loss_scale {cfg.fp16.loss_scale:g}: LAMB needs dynamic loss "
                        "scaling, as DeepSpeed 0.19.8 refuses a static scale with it (\"lamb optimizer requires "
                        "dynamic loss scaling\", whether or not fp16 is enabled); set fp16.loss_scale 0")
    autocast = cfg.torch_autocast
    in_bf16 = autocast.dtype is not None and AUTOCAST_DTYPES[autocast.dtype] == torch.bfloat16
    if autocast.enabled and (cfg.fp16.enabled or (cfg.bf16.enabled and not in_bf16)):
        dtype = "unset (torch's default for the device: fp16 on a GPU)" if autocast.dtype is None else autocast.dtype
        problems.append("torch_autocast.enabled with "
                        f"{'fp16' if cfg.fp16.enabled else 'bf16'}.enabled and torch_autocast.dtype {dtype} is not "
                        "supported: shardwise runs autocast from fp32 parameters, or in bf16 over bf16 parameters "
                        "(DeepSpeed 0.19.8 also runs the 16-bit model under another autocast dtype, communicating "
                        "some gradients in that dtype); set torch_autocast.dtype \"bf16\" with bf16, or use one of "
                        "the two blocks")
    micro_batches = cfg.pipeline_parallel.micro_batches
    if batch_known and micro_batches != cfg.gradient_accumulation_steps:
        problems.append(
            f"pipeline_parallel.micro_batches {micro_batches} != gradient_accumulation_steps "
            f"{cfg.gradient_accumulation_steps}: a pipeline step runs one micro-batch per accumulation step"
        )
    return problems


def _dynamic_scaling_contradictions(cfg: ShardwiseConfig) -> list[str]:
    """The fp16 block's ranges, which matter only while the scale is dynamic: with fp16 off
    or a static `loss_scale`, DeepSpeed 0.19.8 takes any value and uses none, and so does
    shardwise. The window and the floor it refuses too; hysteresis 0 and an initial power
    above 64 it accepts, but they cannot train (docs/deepspeed.md, "Where shardwise is
    stricter than DeepSpeed"). A negative power is a first scale below 1, which both scalers
    run alike."""
    if not scales_dynamically(cfg):
        return []
    fp16, problems = cfg.fp16, []
    if fp16.loss_scale_window < 1:
        problems.append(f"fp16.loss_scale_window {fp16.loss_scale_window} must be at least 1 with dynamic loss "
                        "scaling (fp16.loss_scale 0): it is the number of clean steps before the scale grows; "
                        "DeepSpeed 0.19.8 refuses it too (\"must be > 0 when dynamic loss scaling is enabled\")")
    if fp16.min_loss_scale <= 0:
        problems.append(f"fp16.min_loss_scale {fp16.min_loss_scale} must be positive with dynamic loss scaling: "
                        "an overflow could halve the scale towards 0, zeroing every gradient; DeepSpeed 0.19.8 "
                        "refuses it too (\"must be > 0 when dynamic loss scaling is enabled\"); its default is 1")
    if fp16.hysteresis < 1:
        problems.append(f"fp16.hysteresis {fp16.hysteresis} must be at least 1 with dynamic loss scaling: it is the "
                        "number of overflows tolerated before the scale halves, and DeepSpeed's scaler counts it down "
                        "to 1, so from 0 it never halves the scale and every step after the first overflow is "
                        "skipped; use 1 (halve at once) or DeepSpeed's default 2")
    power = fp16.initial_scale_power
    if power > MAX_INITIAL_SCALE_POWER:
        problems.append(
            f"fp16.initial_scale_power: {power} is above {MAX_INITIAL_SCALE_POWER}: the loss is multiplied by "
            f"2**{power} in fp32, and fp16 gradients overflow above 2**{FP16_MAX_EXPONENT}, so every step overflows "
            "and is skipped, each overflow halving the scale once (after fp16.hysteresis overflows are tolerated): "
            f"about {power - FP16_MAX_EXPONENT} steps would be skipped before the first update. Use at most "
            f"{MAX_INITIAL_SCALE_POWER} (DeepSpeed's default is 16)")
    return problems


def _offload_contradictions(cfg: ShardwiseConfig) -> list[str]:
    """Optimizer offload needs partitioned states (a stage >= 1): at stage 0 it is ignored
    (find_ignored). A fraction of it (`ratio`) is offloaded at stages 1-3, where DeepSpeed
    offloads one at stage 3 only. Parameter offload applies at stage 3 only; below it
    DeepSpeed ignores it, and so does shardwise (find_ignored)."""
    zero = cfg.zero_optimization
    optimizer = zero.offload_optimizer.device
    param = zero.offload_param.device if partitions_parameters(zero.stage) else "none"
    problems = []
    ratio = zero.offload_optimizer.ratio
    nothing_offloaded = optimizer == "none" or not partitions_optimizer(zero.stage)  # stage 0 ignores the device
    if ratio < 1 and nothing_offloaded and not partitions_parameters(zero.stage):
        problems.append(f"zero_optimization.offload_optimizer.ratio {ratio} with offload_optimizer.device "
                        f"'{optimizer}' at zero_optimization.stage {zero.stage}: nothing is offloaded, so there is no "
                        "fraction to offload, "
                        "and DeepSpeed 0.19.8 refuses a ratio below 1 under stage 3 (\"Partial offloading "
                        "only supported for ZeRO Stage 3\"); set offload_optimizer.device 'cpu' or 'nvme' (shardwise "
                        "offloads a fraction at stages 1-3), or remove ratio")
    if ratio < 1 and param != "none":
        problems.append(f"zero_optimization.offload_optimizer.ratio {ratio} with zero_optimization.offload_param."
                        f"device '{param}' is not supported: the part updated on the device trains the parameter "
                        "shards in place, which then must stay on the device; offload the whole optimizer (ratio "
                        "1.0) or keep the parameters on the device")
    if optimizer != "none" and zero.mics_shard_size != -1:
        problems.append("zero_optimization.mics_shard_size with an offloaded optimizer is not supported: the "
                        "all-reduce across replica groups would run on host memory; use one or the other")
    return problems


def _zero_plus_plus_contradictions(cfg: ShardwiseConfig) -> list[str]:
    """ZeRO++ at stage 3 (below it the keys are ignored, as DeepSpeed does: config/policies.py)."""
    zero = cfg.zero_optimization
    keys = [key for key, on in (("zero_quantized_weights", zero.zero_quantized_weights),
                                ("zero_hpz_partition_size", zero.zero_hpz_partition_size > 1),
                                ("zero_quantized_gradients", zero.zero_quantized_gradients)) if on]
    if not keys or not partitions_parameters(zero.stage):
        return []
    problems = []
    if zero.mics_shard_size != -1:
        problems.append(f"zero_optimization.{' and '.join(keys)} (ZeRO++) with mics_shard_size is not supported: "
                        "both keep traffic inside a node in their own way; use one of them")
    if zero.zero_hpz_partition_size > 1 and zero.offload_param.device != "none":
        problems.append(f"zero_optimization.zero_hpz_partition_size {zero.zero_hpz_partition_size} with "
                        f"offload_param.device '{zero.offload_param.device}' is not supported: the secondary "
                        "partition lives on the device, which parameter offload empties; use one of them")
    return problems


def _zenflow_contradictions(cfg: ShardwiseConfig, batch_known: bool) -> list[str]:
    """ZenFlow (runtime/zero/zenflow.py) updates part of the model on the device and the
    rest on the CPU: it needs the optimizer on the CPU and a stage that partitions it (1-3),
    and it accumulates over its own update interval."""
    zero = cfg.zero_optimization
    zenflow = zero.zenflow
    if zenflow is None:
        return []
    problems = []
    if zero.offload_optimizer.device != "cpu":
        problems.append(f"zero_optimization.zenflow needs zero_optimization.offload_optimizer.device 'cpu' (got "
                        f"'{zero.offload_optimizer.device}'): ZenFlow splits the update between the device and "
                        "the CPU optimizer")
    if zero.stage not in (1, 2, 3):
        problems.append(f"zero_optimization.zenflow at zero_optimization.stage {zero.stage} is not supported: "
                        "it splits the optimizer's update, which stage 0 does not partition (DeepSpeed 0.19.8 "
                        "accepts it at initialize and fails at the first step: \"object has no attribute "
                        "'zenflow_need_update'\"); use stage 2 or 3")
    if zero.offload_optimizer.ratio < 1:
        problems.append("zero_optimization.zenflow with offload_optimizer.ratio < 1 is not supported: ZenFlow "
                        "chooses what the device updates itself; remove ratio")
    if cfg.fp16.enabled:
        problems.append("zero_optimization.zenflow with fp16.enabled is not supported: a step skipped for "
                        "overflow would leave the device's selective update and the host's sum apart; use bf16")
    if batch_known and cfg.gradient_accumulation_steps != 1:
        problems.append(f"zero_optimization.zenflow with gradient_accumulation_steps "
                        f"{cfg.gradient_accumulation_steps}: ZenFlow accumulates over zenflow.update_interval "
                        "itself (DeepSpeed replaces gradient_accumulation_steps by it); set it to 1")
    interval = zenflow.select_interval
    if (zenflow.select_strategy == "step" and isinstance(interval, int) and isinstance(zenflow.update_interval, int)
            and interval < zenflow.update_interval):
        problems.append(f"zero_optimization.zenflow.select_interval {interval} < update_interval "
                        f"{zenflow.update_interval}: DeepSpeed requires columns to change only at an update")
    return problems


def _summed_gradient_contradictions(cfg: ShardwiseConfig) -> list[str]:
    """`gradient_allreduce_op` "sum": ZeRO's reduction (runtime/zero/gradients.py) sums
    instead of averaging. DeepSpeed 0.19.8 refuses it at stage 3, with ZenFlow and with
    DeepCompile; the 1-bit optimizers exchange their own (averaged) momentum."""
    if cfg.gradient_allreduce_op != "sum":
        return []
    zero = cfg.zero_optimization
    refused_by_deepspeed = [(partitions_parameters(zero.stage), "zero_optimization.stage 3", "ZeRO stage 3"),
                            (zero.zenflow is not None, "zero_optimization.zenflow", "ZenFlow"),
                            (cfg.compile.deepcompile, "compile.deepcompile", "DeepCompile")]
    problems = [f"gradient_allreduce_op \"sum\" with {key}: DeepSpeed 0.19.8 refuses it too (\"gradient_allreduce_op="
                f"'sum' is not supported with {words}\"); remove gradient_allreduce_op (the mean) or {key}"
                for on, key, words in refused_by_deepspeed if on]
    if cfg.optimizer is not None and cfg.optimizer.type in COMPRESSED_OPTIMIZERS:
        problems.append(f"gradient_allreduce_op \"sum\" with optimizer.type '{cfg.optimizer.type}' is not "
                        "supported: after its warm-up it exchanges the ranks' compressed momentum, averaged; remove "
                        "gradient_allreduce_op or use another optimizer")
    return problems


def _onebit_contradictions(cfg: ShardwiseConfig) -> list[str]:
    """1-bit Adam / LAMB and 0/1 Adam exchange every rank's momentum (0/1 Adam: gradient or
    accumulated update) of the whole model themselves (optim/onebit.py): stages 0-2 (0/1
    Adam: 0), one exchange group, the momentum on the device."""
    if cfg.optimizer is None or cfg.optimizer.type not in COMPRESSED_OPTIMIZERS:
        return []
    name, problems, zero = cfg.optimizer.type, [], cfg.zero_optimization
    if name == "ZeroOneAdam" and zero.stage != 0:
        problems.append(f"optimizer.type 'ZeroOneAdam' runs at zero_optimization.stage 0 only, not {zero.stage}, "
                        "as in DeepSpeed (\"0/1 Adam is not compatible with ZeRO\"): between synchronisations "
                        "every rank takes whole local steps with the whole momentum, variance and accumulated "
                        "update; use stage 0, or OneBitAdam at stages 1-2")
    elif partitions_parameters(zero.stage):
        problems.append(f"optimizer.type '{name}' runs at zero_optimization.stage 0, 1 or 2, not 3: after "
                        "freeze_step each rank folds its whole local gradient into the whole model's momentum and "
                        "keeps a whole error-feedback buffer (10 bytes per parameter with 16-bit gradients, more "
                        "than stage 3 saves by partitioning the 2-byte parameters), and stage 3 frees each "
                        "module's gathered parameters when its gradients are reduced, which that phase never does; "
                        "use stage 2 (masters, variance and server error partitioned)")
    if partitions_optimizer(zero.stage) and not partitions_parameters(zero.stage) and zero.mics_shard_size != -1:
        problems.append(f"optimizer.type '{name}' with zero_optimization.mics_shard_size is not supported: the "
                        "compressed momentum exchange runs over the shard group alone, and replicas would need a "
                        "second exchange; leave mics_shard_size at -1")
    if zero.offload_optimizer.device != "none":
        problems.append(f"optimizer.type '{name}' with zero_optimization.offload_optimizer.device "
                        f"'{zero.offload_optimizer.device}' is not supported: every step folds the whole momentum "
                        "and exchanges it on the device; leave offload_optimizer.device 'none'")
    parallel = {"tensor_parallel.size": cfg.tensor_parallel.size, "sequence_parallel.size": cfg.sequence_parallel.size,
                "pipeline_parallel.size": cfg.pipeline_parallel.size}
    for key, size in parallel.items():
        if size > 1:
            problems.append(f"optimizer.type '{name}' with {key} {size} is not supported yet: the compressed "
                            "momentum exchange is built for data parallelism alone; use Adam/AdamW or size 1")
    return problems


def _caller_ended_window_contradictions(cfg: ShardwiseConfig) -> list[str]:
    """managed_gradient_accumulation false: every step() ends the window. DeepSpeed 0.19.8
    refuses it with overlap_comm below stage 2, with a pipeline and with DeepCompile; what
    else accumulates on its own schedule is refused too."""
    if cfg.managed_gradient_accumulation:
        return []
    key, zero, problems = "managed_gradient_accumulation false", cfg.zero_optimization, []
    if zero.overlap_comm and not partitions_gradients(zero.stage):
        problems.append(f"{key} with zero_optimization.overlap_comm true at stage {zero.stage}: stages 0-1 reduce "
                        "the window's gradients in step(), after backward, so there is nothing to overlap; "
                        "DeepSpeed 0.19.8 refuses it too (\"supports ZeRO overlap_comm only with ZeRO stage 2\"); "
                        "set overlap_comm false")
    if cfg.pipeline_parallel.size > 1:
        problems.append(f"{key} with pipeline_parallel.size {cfg.pipeline_parallel.size}: a pipeline's train_batch "
                        "runs its schedule's micro-batches per step; DeepSpeed 0.19.8 refuses it too")
    if cfg.compile.deepcompile:
        problems.append(f"{key} with compile.deepcompile: DeepSpeed 0.19.8 refuses it (\"not supported with "
                        "DeepCompile\"); remove one of them")
    if zero.zenflow is not None:
        problems.append(f"{key} with zero_optimization.zenflow: ZenFlow accumulates over its own update interval; "
                        "remove one of them")
    if cfg.optimizer is not None and cfg.optimizer.type in COMPRESSED_OPTIMIZERS:
        problems.append(f"{key} with optimizer.type '{cfg.optimizer.type}': the compressed optimizers exchange the "
                        "window's local gradients at the boundary the engine counts; use managed accumulation")
    return problems


def _sequence_parallel_contradictions(cfg: ShardwiseConfig) -> list[str]:
    """Megatron sequence parallelism splits the sequence over the tensor group, so it needs
    one and no sequence group of its own; Ulysses splits over the sequence group."""
    tensor, sequence = cfg.tensor_parallel, cfg.sequence_parallel
    megatron = tensor.sequence_parallel or sequence.mode == "megatron"
    problems = []
    if tensor.sequence_parallel and sequence.mode == "ulysses" and sequence.size > 1:
        problems.append(f"tensor_parallel.sequence_parallel (Megatron) and sequence_parallel.mode 'ulysses' with "
                        f"sequence_parallel.size {sequence.size} are both set: choose one sequence parallelism")
    elif megatron and sequence.size > 1:
        problems.append(f"sequence_parallel.size {sequence.size} with Megatron sequence parallelism: it splits the "
                        "sequence over the tensor group (tensor_parallel.size), so leave sequence_parallel.size at 1")
    if tensor.sequence_parallel and tensor.size == 1:
        problems.append("tensor_parallel.sequence_parallel needs tensor_parallel.size > 1: Megatron sequence "
                        "parallelism splits the sequence over the tensor group")
    return problems


def _pipeline_contradictions(cfg: ShardwiseConfig, batch_known: bool) -> list[str]:
    """Schedule, virtual stages, split points and what pipeline parallelism composes with."""
    pipe = cfg.pipeline_parallel
    problems = []
    if pipe.schedule == "interleaved" and pipe.virtual_stages < 2:
        problems.append("pipeline_parallel.schedule 'interleaved' needs pipeline_parallel.virtual_stages >= 2 "
                        "(model chunks per rank); with one chunk use schedule '1f1b'")
    if pipe.virtual_stages > 1 and pipe.schedule != "interleaved":
        problems.append(f"pipeline_parallel.virtual_stages {pipe.virtual_stages} needs pipeline_parallel.schedule "
                        f"'interleaved': schedule '{pipe.schedule}' runs one chunk per rank")
    if pipe.split_points is not None and len(pipe.split_points) != pipe.size * pipe.virtual_stages - 1:
        problems.append(f"pipeline_parallel.split_points has {len(pipe.split_points)} entries: give "
                        f"size x virtual_stages - 1 = {pipe.size * pipe.virtual_stages - 1} (the first layer of "
                        "every stage after the first)")
    if pipe.size == 1:
        return problems
    if batch_known and pipe.schedule == "interleaved" and (pipe.micro_batches or 0) % pipe.size:
        problems.append(f"pipeline_parallel.micro_batches {pipe.micro_batches} is not a multiple of "
                        f"pipeline_parallel.size {pipe.size}: the interleaved schedule moves micro-batches through "
                        "the chunks in groups of size; raise gradient_accumulation_steps to a multiple")
    if partitions_parameters(cfg.zero_optimization.stage):
        problems.append(f"zero_optimization.stage 3 with pipeline_parallel.size {pipe.size} is not supported: "
                        "stage 3 gathers parameters for one forward and then its backward, which the pipeline "
                        "schedules interleave across micro-batches; use zero_optimization.stage 1 or 2")
    megatron = cfg.tensor_parallel.sequence_parallel or cfg.sequence_parallel.mode == "megatron"
    if cfg.sequence_parallel.size > 1 or (megatron and cfg.tensor_parallel.size > 1):
        problems.append(f"sequence parallelism with pipeline_parallel.size {pipe.size} is not supported yet: the "
                        "stages exchange whole-sequence hidden states; use tensor parallelism without "
                        "sequence_parallel, or pipeline_parallel.size 1")
    return problems


def _activation_contradictions(cfg: ShardwiseConfig) -> list[str]:
    """`every_k` belongs to the every_k policy; Pa splits whole layer inputs over the tensor
    group, which Megatron sequence parallelism has already split; a √n segment runs several
    layers from its first, which the per-layer hooks of sequence parallelism do not expect."""
    block = cfg.activation_checkpointing
    tensor, sequence = cfg.tensor_parallel, cfg.sequence_parallel
    megatron = tensor.sequence_parallel or sequence.mode == "megatron"
    problems = []
    if block.every_k != type(block).model_fields["every_k"].default and block.policy != "every_k":
        problems.append(f"activation_checkpointing.every_k {block.every_k} only applies to policy 'every_k', but "
                        f"activation_checkpointing.policy is '{block.policy}': set the policy to 'every_k' or "
                        "remove every_k")
    if block.partition_activations and megatron and tensor.size > 1:
        problems.append("activation_checkpointing.partition_activations with Megatron sequence parallelism "
                        "(tensor_parallel.sequence_parallel): the layer inputs are already split over the tensor "
                        "group; leave partition_activations off")
    if block.policy == "sqrt" and (sequence.size > 1 or (megatron and tensor.size > 1)):
        problems.append("activation_checkpointing.policy 'sqrt' with sequence parallelism is not supported: its "
                        "segments run several layers at once, past the per-layer sequence hooks; use 'full', "
                        "'every_k' or 'selective'")
    return problems


def _bf16_masters_contradictions(cfg: ShardwiseConfig) -> list[str]:
    """bf16 masters are ZeRO's partitioned master copy, updated on the device together with
    bf16 optimizer states. DeepSpeed (base_optimizer.py `_configure_master_weights`) runs
    bf16 masters beside fp32 states only with its CPU Adam on an offloaded optimizer, which
    shardwise's offloaded step (fp32 on the host) does not do."""
    zero, bf16 = cfg.zero_optimization, cfg.bf16
    if not bf16.bf16_master_weights_and_grads:
        return []
    problems = []
    if not partitions_optimizer(zero.stage):
        problems.append("bf16.bf16_master_weights_and_grads needs zero_optimization.stage 1, 2 or 3: the masters it "
                        "keeps in bf16 are ZeRO's partitioned copies (DeepSpeed refuses stage 0 too)")
    if zero.offload_optimizer.device != "none":
        problems.append("bf16.bf16_master_weights_and_grads with zero_optimization.offload_optimizer.device "
                        f"'{zero.offload_optimizer.device}' is not supported yet: the offloaded step keeps fp32 "
                        "masters and states on the host; keep the optimizer on the device")
    elif not bf16.bf16_optimizer_states:
        problems.append("bf16.bf16_master_weights_and_grads without bf16.bf16_optimizer_states: fp32 optimizer "
                        "states beside bf16 masters are DeepSpeed's CPU Adam on an offloaded optimizer (it refuses "
                        "them on the device too); set bf16_optimizer_states true")
    return problems


def _compile_contradictions(cfg: ShardwiseConfig) -> list[str]:
    """CUDA graphs replay kernels on the addresses they were captured with, and ZeRO-3
    frees each module's gathered parameters after use and gathers them into storage
    allocated anew: a replay would read freed memory, or another tensor's
    (runtime/compile/policy.py finds the settings that capture graphs)."""
    if not partitions_parameters(cfg.zero_optimization.stage):
        return []
    return [f"compile.{setting} uses CUDA graphs, which zero_optimization.stage 3 cannot run: a graph replays "
            "kernels on the addresses it captured, and stage 3 frees each module's parameters after use and "
            "gathers them into newly allocated storage; use compile.mode 'max-autotune-no-cudagraphs' or 'default' "
            "(no CUDA graph options), or zero_optimization.stage 2 or lower"
            for setting in compile_policy(cfg).cuda_graph_settings()]


def find_data_types_contradictions(cfg: ShardwiseConfig) -> list[str]:
    """`data_types` against the training dtype. DeepSpeed 0.19.8 (runtime/engine.py):

    - `param_dtype` must be the training dtype (`_assert_valid_mixed_precision_config`);
    - `grad_accum_dtype` equal to the training dtype: gradients accumulate in it, as
      without the key;
    - `grad_accum_dtype` fp32 beside fp16/bf16: honoured at ZeRO stages 1-3, where the
      gradient buffers become fp32 (runtime/zero/gradients.py); refused without ZeRO, as
      DeepSpeed refuses it ("unsupported mix of model_dtype and grad_accum_dtype");
    - a 16-bit `grad_accum_dtype` other than the training dtype: refused at every stage (a
      sum kept in the other 16-bit dtype loses bits both ways; DeepSpeed refuses it without
      ZeRO);
    - `grad_accum_dtype` fp32 with bf16 masters (`bf16.bf16_master_weights_and_grads`):
      refused, the bf16 masters take bf16 gradients."""
    data_types = cfg.data_types
    precision = _training_precision(cfg)
    problems = []
    param = DATA_TYPE_NAMES.get(data_types.param_dtype)
    if param is not None and param != precision:
        problems.append(f"data_types.param_dtype '{data_types.param_dtype}' trains in {param} but the config "
                        f"trains in {precision} (the fp16 and bf16 blocks): DeepSpeed 0.19.8 refuses the mix too "
                        "(\"conflicts with the enabled precision mode\"); set the matching fp16/bf16 'enabled' "
                        "flag or remove data_types.param_dtype")
    accumulate = DATA_TYPE_NAMES.get(data_types.grad_accum_dtype)
    if accumulate is None or accumulate == precision:
        return problems
    if accumulate == "fp32" and not partitions_optimizer(cfg.zero_optimization.stage):
        problems.append(f"data_types.grad_accum_dtype '{data_types.grad_accum_dtype}' with {precision}.enabled "
                        "at zero_optimization.stage 0: without ZeRO, gradients accumulate in the parameters' dtype "
                        f"({precision}), and DeepSpeed 0.19.8 refuses another (\"unsupported mix of model_dtype and "
                        "grad_accum_dtype\"); use zero_optimization.stage 1, 2 or 3, or remove "
                        "data_types.grad_accum_dtype")
    elif accumulate == "fp32" and cfg.bf16.bf16_master_weights_and_grads:
        problems.append(f"data_types.grad_accum_dtype '{data_types.grad_accum_dtype}' with "
                        "bf16.bf16_master_weights_and_grads: the bf16 masters take bf16 gradients, so there is no "
                        "fp32 gradient to accumulate; remove one of the two")
    elif accumulate != "fp32":
        problems.append(f"data_types.grad_accum_dtype '{data_types.grad_accum_dtype}' while training in "
                        f"{precision}: shardwise accumulates gradients in the training dtype or in fp32, never in "
                        "another 16-bit dtype, and DeepSpeed 0.19.8 refuses the mix without ZeRO "
                        f"(\"unsupported mix of model_dtype and grad_accum_dtype\"); use '{precision}' or 'fp32', or "
                        "remove data_types.grad_accum_dtype")
    return problems


def _training_precision(cfg: ShardwiseConfig) -> str:
    """The training dtype under `data_types`' names: "fp16", "bf16" or "fp32"."""
    return "fp16" if cfg.fp16.enabled else "bf16" if cfg.bf16.enabled else "fp32"
