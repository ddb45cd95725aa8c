"""Which ZeRO stage, offload and recomputation to use: evaluate every option, pick the fastest that fits.

Speed order. Stages 0-2 move the same bytes per step as plain data parallelism (docs/formulas.md#communication-per-step),
so among them the lower stage wins, and none of them is given up for recomputation
before the others were tried without it. Every later option costs real time: stage 3
gathers parameters again (1.5x the traffic), optimizer offload adds PCIe transfers and a
CPU optimizer step, parameter offload adds parameter transfers on every gather, NVMe is
slower than host memory. Recomputation costs at most one more forward (about a third of
the compute; selective recomputation almost nothing), so before each of those steps the
current option is tried with selective, then full recomputation. Stage 1 with a CPU
optimizer is evaluated but never recommended: stage 2 with a CPU optimizer moves the same
bytes and keeps less on the GPU.

Tensor parallelism. With --tp T every option is evaluated for one tensor rank's shard
(Ψ_T) sharded by ZeRO over N = GPUs / T, with the per-rank activations. Without it, when
ZeRO alone needs offload or does not fit, T = 2, 4, 8 (inside one node, dividing the GPUs,
heads and vocabulary) are tried with Megatron sequence parallelism and the smallest that
fits without offload is suggested beside the recommendation: within a node the tensor
group's collectives run over NVLink every layer, which usually costs less than PCIe
offload, but the choice stays the user's, so both are shown. T does not shrink model
states below what ZeRO-3 already reaches over the same GPUs; it shrinks activations, the
stage-3 working set, and lets lower stages fit.
"""

from __future__ import annotations

from dataclasses import replace
from math import ceil
from typing import Iterator

from shardwise.tools.planner.explain import explain_with_suggestion
from shardwise.formulas.memory import (
    NO_OFFLOAD,
    RECOMPUTE_MODES,
    Device,
    Offload,
    RecomputeMode,
    placed_model_state_bytes,
)
from shardwise.formulas.layers import stage3_gather_bytes
from shardwise.formulas.parallel_activation import NO_MODEL_PARALLEL, ModelParallel, parallel_activation_bytes
from shardwise.formulas.stages import partitions_optimizer, partitions_parameters
from shardwise.tools.planner.optimizers import planned_optimizer, planned_state_bytes
from shardwise.tools.planner.results import DEFAULT_HEADROOM, Estimate, Hardware, OptionEstimate, Recommendation
from shardwise.formulas.model_shape import ModelShape

__all__ = ["DEFAULT_HEADROOM", "Estimate", "Hardware", "ModelParallel", "OptionEstimate", "Recommendation", "estimate"]

TENSOR_SIZES = (2, 4, 8)  # tried in order when ZeRO alone does not fit: the smallest within a node

# Table order: by stage, then by how much leaves the GPU.
OPTIONS: tuple[tuple[int, Offload], ...] = (
    (0, NO_OFFLOAD),
    (1, NO_OFFLOAD),
    (1, Offload("cpu")),
    (2, NO_OFFLOAD),
    (2, Offload("cpu")),
    (3, NO_OFFLOAD),
    (3, Offload("cpu")),
    (3, Offload("cpu", "cpu")),
    (3, Offload("nvme")),
    (3, Offload("nvme", "nvme")),
)
DATA_PARALLEL_TRAFFIC = ((0, NO_OFFLOAD), (1, NO_OFFLOAD), (2, NO_OFFLOAD))
EXTRA_TRAFFIC = (
    (3, NO_OFFLOAD),
    (2, Offload("cpu")),
    (3, Offload("cpu")),
    (3, Offload("cpu", "cpu")),
    (3, Offload("nvme")),
    (3, Offload("nvme", "nvme")),
)


def preference_order(modes: tuple[RecomputeMode, ...]) -> Iterator[tuple[tuple[int, Offload], RecomputeMode]]:
    """(option, recomputation) pairs, fastest first; see the module docstring."""
    for mode in modes:
        for option in DATA_PARALLEL_TRAFFIC:
            yield option, mode
    for option in EXTRA_TRAFFIC:
        for mode in modes:
            yield option, mode


def estimate(
    shape: ModelShape,
    hardware: Hardware,
    micro_batch: int = 1,
    seq_len: int = 2048,
    dtype: str = "bf16",
    optimizer: str = "adam",
    parallel: ModelParallel = NO_MODEL_PARALLEL,
    *,
    bf16_masters: bool = False,
    grad_accum_dtype: str | None = None,
) -> Estimate:
    """Evaluate every stage/offload option for `shape` on `hardware` (split over `parallel`'s
    tensor, sequence or pipeline group; with P stages each rank holds ⌈Ψ_T / P⌉ parameters
    and ZeRO-3 is not offered) and recommend one. Without model parallelism, when ZeRO alone
    needs offload or does not fit, the smallest tensor-parallel size that fits without
    offload is attached as `tensor_suggestion`. `bf16_masters`: DeepSpeed's bf16 master
    weights, gradients and optimizer states (K of 2-byte states; stages 1-3 on the device only,
    as the engine runs them). `grad_accum_dtype` "fp32" beside 16-bit training (DeepSpeed's
    `data_types.grad_accum_dtype`): 4-byte gradient buffers, at stages 1-3 (as the engine
    and DeepSpeed run it)."""
    if micro_batch <= 0 or seq_len <= 0:
        raise ValueError(f"micro_batch and seq_len must be positive, got {micro_batch} and {seq_len}")
    if grad_accum_dtype == dtype:
        grad_accum_dtype = None
    if grad_accum_dtype not in (None, "fp32") or (grad_accum_dtype and bf16_masters):
        raise ValueError(f"gradients accumulate in the training dtype or in fp32 beside 16-bit training, and bf16 "
                         f"masters take bf16 gradients; got --grad-accum-dtype {grad_accum_dtype} with --dtype {dtype}"
                         f"{' and --bf16-masters' if bf16_masters else ''}")
    check_parallel(shape, hardware, parallel, seq_len)
    k = planned_state_bytes(optimizer, dtype, bf16_masters=bf16_masters)
    activations = _activations(shape, micro_batch, seq_len, dtype, parallel)
    modes = RECOMPUTE_MODES if activations is not None else ("none",)
    local = ceil(shape.params_per_tensor_rank(parallel.tensor) / parallel.pipeline)
    frozen_local = 0
    if shape.frozen_params:  # the trained share is spread over the model like the rest
        trained_local = max(1, ceil(shape.trainable_params / (parallel.tensor * parallel.pipeline)))
        local, frozen_local = trained_local, max(0, local - trained_local)
    inputs = Estimate(shape, hardware, micro_batch, seq_len, dtype, optimizer, k, activations, (), None,
                      parallel=parallel, params_per_rank=local, frozen_per_rank=frozen_local,
                      bf16_masters=bf16_masters, grad_accum_dtype=grad_accum_dtype)
    options = tuple(
        _evaluate_option(stage, offload, inputs, modes)
        for stage, offload in OPTIONS
        if _offered(stage, offload, parallel, optimizer, bf16_masters, grad_accum_dtype)
    )
    partial = replace(inputs, options=options)
    recommendation, ruled_out = _recommend(partial, modes)
    partial = replace(partial, recommendation=recommendation, ruled_out=ruled_out)
    if parallel == NO_MODEL_PARALLEL and (recommendation is None or recommendation.option.offload != NO_OFFLOAD):
        partial = replace(partial, tensor_suggestion=_suggest_tensor_parallel(partial))
    return replace(partial, explanation=tuple(explain_with_suggestion(partial)))


def check_parallel(shape: ModelShape, hardware: Hardware, parallel: ModelParallel, seq_len: int) -> None:
    """The sizes the engine would refuse (tensor_parallel.size, sequence_parallel.size,
    pipeline_parallel.size)."""
    both = parallel.tensor * parallel.sequence
    for flag, size in (("--tp", parallel.tensor), ("--sp", parallel.sequence), ("--tp × --sp", both)):
        if size == 1:
            continue
        if hardware.num_gpus % size:
            raise ValueError(f"{flag} {size} does not divide --gpus {hardware.num_gpus}: every group needs {size} GPUs")
        if shape.num_heads is not None and shape.num_heads % size:
            raise ValueError(f"{flag} {size} does not divide the {shape.num_heads} attention heads: each rank "
                             "takes heads / size of them")
    if parallel.tensor > 1 and shape.vocab_size is not None and shape.vocab_size % parallel.tensor:
        raise ValueError(f"--tp {parallel.tensor} does not divide the vocabulary of {shape.vocab_size}: the embedding "
                         "and output layer are split by rows")
    if parallel.pipeline > 1:
        if hardware.num_gpus % (parallel.tensor * parallel.pipeline):
            raise ValueError(f"--pp {parallel.pipeline} × --tp {parallel.tensor} does not divide --gpus "
                             f"{hardware.num_gpus}: every model replica needs {parallel.tensor * parallel.pipeline} GPUs")
        if shape.num_layers is not None and shape.num_layers < parallel.pipeline:
            raise ValueError(f"--pp {parallel.pipeline} is more stages than the model's {shape.num_layers} layers")
    split = parallel.sequence * (parallel.tensor if parallel.megatron_sp else 1)
    if seq_len % split:
        raise ValueError(f"--seq-len {seq_len} does not split over {split} sequence ranks")


def _suggest_tensor_parallel(single: Estimate) -> Estimate | None:
    """The smallest T in 2, 4, 8 (inside one node, dividing the GPUs, heads and vocabulary)
    with Megatron sequence parallelism at which some ZeRO stage fits without offload."""
    hardware, shape = single.hardware, single.shape
    for size in TENSOR_SIZES:
        if size > hardware.gpus_per_node or size > hardware.num_gpus:
            break
        parallel = ModelParallel(tensor=size, megatron_sp=True)
        try:
            check_parallel(shape, hardware, parallel, single.seq_len)
        except ValueError:
            continue
        candidate = estimate(shape, hardware, single.micro_batch, single.seq_len, single.dtype, single.optimizer,
                             parallel, bf16_masters=single.bf16_masters, grad_accum_dtype=single.grad_accum_dtype)
        if candidate.recommendation is not None and candidate.recommendation.option.offload == NO_OFFLOAD:
            return candidate
    return None


def _offered(stage: int, offload: Offload, parallel: ModelParallel, optimizer: str, bf16_masters: bool,
             grad_accum_dtype: str | None = None) -> bool:
    """Whether the engine would run this option: it refuses ZeRO-3 with pipeline
    parallelism, bf16 masters at stage 0 or with offload, fp32 gradient accumulation at
    stage 0, and runs an optimizer at the stages and offload its spec allows (the 1-bit
    optimizers: stages 0-2 on the device, runtime/optim/onebit.py)."""
    if partitions_parameters(stage) and parallel.pipeline > 1:
        return False
    if bf16_masters and (offload != NO_OFFLOAD or not partitions_optimizer(stage)):
        return False
    if grad_accum_dtype is not None and not partitions_optimizer(stage):
        return False
    spec = planned_optimizer(optimizer)
    return stage in spec.zero_stages and (spec.offload or offload == NO_OFFLOAD)


def _activations(shape: ModelShape, micro_batch: int, seq_len: int, dtype: str,
                 parallel: ModelParallel) -> dict[RecomputeMode, int] | None:
    layers, hidden, heads = shape.num_layers, shape.hidden_size, shape.num_heads
    if layers is None or hidden is None or heads is None:
        return None
    return {
        mode: parallel_activation_bytes(layers, hidden, heads, shape.vocab_size, seq_len=seq_len,
                                        micro_batch=micro_batch, dtype=dtype, recompute=mode, parallel=parallel)
        for mode in RECOMPUTE_MODES
    }


def _evaluate_option(
    stage: int, offload: Offload, inputs: Estimate, modes: tuple[RecomputeMode, ...]
) -> OptionEstimate:
    """One option's memory per device for the estimate's `inputs` (everything but its
    options: the shape, hardware, dtype, K, activations and the per-rank parameter counts),
    and which of the recomputation `modes` fit on the GPU."""
    hardware, dtype = inputs.hardware, inputs.dtype
    per_rank = placed_model_state_bytes(
        inputs.params_per_rank, inputs.zero_ranks, stage, offload, dtype=dtype,
        optimizer_state_bytes_per_param=inputs.optimizer_state_bytes,
        own_terms=planned_optimizer(inputs.optimizer).state_terms,
        frozen_params=inputs.frozen_per_rank, grad_dtype=inputs.grad_accum_dtype,
    )
    largest = inputs.shape.largest_layer_params
    gather = 0
    if partitions_parameters(stage) and largest:
        gather = stage3_gather_bytes(ceil(largest / inputs.parallel.tensor), dtype)
    cpu = hardware.ranks_per_node * sum(per_rank["cpu"].values())
    nvme = hardware.ranks_per_node * sum(per_rank["nvme"].values())
    gpu_states = sum(per_rank["gpu"].values())
    shortfall: Device | None = None
    fitting: tuple[RecomputeMode, ...] = ()
    if cpu > hardware.usable_bytes("cpu"):
        shortfall = "cpu"
    elif nvme > hardware.usable_bytes("nvme"):
        shortfall = "nvme"
    else:
        usable_gpu = hardware.usable_bytes("gpu")
        fitting = tuple(m for m in modes if gpu_states + gather + inputs.activation(m) <= usable_gpu)
        shortfall = None if fitting else "gpu"
    return OptionEstimate(stage, offload, per_rank, gather, cpu, nvme, fitting, shortfall)


def _recommend(
    partial: Estimate, modes: tuple[RecomputeMode, ...]
) -> tuple[Recommendation | None, tuple[OptionEstimate, ...]]:
    """The first (option, recomputation) pair that fits, and the other options tried before it."""
    tried: list[OptionEstimate] = []
    offered = {(option.stage, option.offload) for option in partial.options}
    for (stage, offload), mode in preference_order(modes):
        if (stage, offload) not in offered:
            continue
        option = partial.option(stage, offload)
        if mode in option.fitting_modes:
            recommendation = Recommendation(option, mode, option.gpu_total(partial.activation(mode)))
            return recommendation, tuple(o for o in tried if o != option)
        if option not in tried:
            tried.append(option)
    return None, tuple(tried)
