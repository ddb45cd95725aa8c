"""Which ZeRO stage, offload and recomputation to use: evaluate every option, pick the fastest that fits.

Speed order. Stages 0-2 move the same bytes per step as plain data parallelism (SPEC §4),
so among them the lower stage wins, and none of them is given up for recomputation
before the others were tried without it. Every later option costs real time: stage 3
gathers parameters again (1.5x the traffic), optimizer offload adds PCIe transfers and a
CPU optimizer step, parameter offload adds parameter transfers on every gather, NVMe is
slower than host memory. Recomputation costs at most one more forward (about a third of
the compute; selective recomputation almost nothing), so before each of those steps the
current option is tried with selective, then full recomputation. Stage 1 with a CPU
optimizer is evaluated but never recommended: stage 2 with a CPU optimizer moves the same
bytes and keeps less on the GPU.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterator

from shardwise.planner.explain import explain
from shardwise.planner.formulas import (
    NO_OFFLOAD,
    RECOMPUTE_MODES,
    Device,
    Offload,
    RecomputeMode,
    activation_bytes,
    optimizer_state_bytes_for,
    placed_model_state_bytes,
    stage3_gather_bytes,
)
from shardwise.planner.results import DEFAULT_HEADROOM, Estimate, Hardware, OptionEstimate, Recommendation
from shardwise.planner.shapes import ModelShape

__all__ = ["DEFAULT_HEADROOM", "Estimate", "Hardware", "OptionEstimate", "Recommendation", "estimate"]

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
) -> Estimate:
    """Evaluate every stage/offload option for `shape` on `hardware` and recommend one."""
    if micro_batch <= 0 or seq_len <= 0:
        raise ValueError(f"micro_batch and seq_len must be positive, got {micro_batch} and {seq_len}")
    k = optimizer_state_bytes_for(optimizer, dtype)
    activations = _activations(shape, micro_batch, seq_len, dtype)
    modes = RECOMPUTE_MODES if activations is not None else ("none",)
    options = tuple(
        _evaluate_option(stage, offload, shape, hardware, dtype, k, activations, modes) for stage, offload in OPTIONS
    )
    partial = Estimate(shape, hardware, micro_batch, seq_len, dtype, optimizer, k, activations, options, None)
    recommendation, ruled_out = _recommend(partial, modes)
    partial = replace(partial, recommendation=recommendation, ruled_out=ruled_out)
    return replace(partial, explanation=tuple(explain(partial)))


def _activations(shape: ModelShape, micro_batch: int, seq_len: int, dtype: str) -> dict[RecomputeMode, int] | None:
    layers, hidden, heads = shape.num_layers, shape.hidden_size, shape.num_heads
    if layers is None or hidden is None or heads is None:
        return None
    return {
        mode: activation_bytes(layers, hidden, heads, shape.vocab_size, seq_len, micro_batch, dtype, mode)
        for mode in RECOMPUTE_MODES
    }


def _evaluate_option(
    stage: int,
    offload: Offload,
    shape: ModelShape,
    hardware: Hardware,
    dtype: str,
    k: int,
    activations: dict[RecomputeMode, int] | None,
    modes: tuple[RecomputeMode, ...],
) -> OptionEstimate:
    per_rank = placed_model_state_bytes(shape.num_params, hardware.num_gpus, stage, offload, dtype, k)
    gather = stage3_gather_bytes(shape.largest_layer_params, dtype) if stage == 3 and shape.largest_layer_params else 0
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
        fitting = tuple(m for m in modes if gpu_states + gather + (activations or {}).get(m, 0) <= usable_gpu)
        shortfall = None if fitting else "gpu"
    return OptionEstimate(stage, offload, per_rank, gather, cpu, nvme, fitting, shortfall)


def _recommend(
    partial: Estimate, modes: tuple[RecomputeMode, ...]
) -> tuple[Recommendation | None, tuple[OptionEstimate, ...]]:
    """The first (option, recomputation) pair that fits, and the other options tried before it."""
    tried: list[OptionEstimate] = []
    for (stage, offload), mode in preference_order(modes):
        option = partial.option(stage, offload)
        if mode in option.fitting_modes:
            recommendation = Recommendation(option, mode, option.gpu_total(partial.activation(mode)))
            return recommendation, tuple(o for o in tried if o != option)
        if option not in tried:
            tried.append(option)
    return None, tuple(tried)
