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

from dataclasses import dataclass, replace
from math import ceil
from typing import Iterator

from shardwise.planner.explain import explain
from shardwise.planner.formulas import (
    GB,
    NO_OFFLOAD,
    RECOMPUTE_MODES,
    Category,
    Device,
    Offload,
    RecomputeMode,
    activation_bytes,
    optimizer_state_bytes_for,
    placed_model_state_bytes,
    stage3_gather_bytes,
)
from shardwise.planner.shapes import ModelShape

DEFAULT_HEADROOM = 0.15


@dataclass(frozen=True)
class Hardware:
    """The cluster. `num_gpus` is the data-parallel size N (no tensor or pipeline split).
    CPU memory and NVMe are per node; `headroom` is the fraction of every memory held back
    for fragmentation, the CUDA context, allocator caching and the framework itself."""

    num_gpus: int
    gpus_per_node: int = 8
    gpu_memory_gb: float = 80.0
    cpu_memory_gb: float = 512.0
    nvme_gb: float = 0.0
    headroom: float = DEFAULT_HEADROOM

    def __post_init__(self) -> None:
        if self.num_gpus <= 0 or self.gpus_per_node <= 0:
            raise ValueError(f"GPU counts must be positive, got num_gpus={self.num_gpus}, gpus_per_node={self.gpus_per_node}")
        if self.gpu_memory_gb <= 0:
            raise ValueError(f"gpu_memory_gb must be positive, got {self.gpu_memory_gb}")
        if self.cpu_memory_gb < 0 or self.nvme_gb < 0:
            raise ValueError(f"cpu_memory_gb and nvme_gb must be >= 0, got {self.cpu_memory_gb} and {self.nvme_gb}")
        if not 0 <= self.headroom < 1:
            raise ValueError(f"headroom must be in [0, 1), got {self.headroom}")

    @property
    def ranks_per_node(self) -> int:
        """Ranks sharing the busiest node's CPU memory and NVMe."""
        return min(self.gpus_per_node, self.num_gpus)

    @property
    def num_nodes(self) -> int:
        return ceil(self.num_gpus / self.gpus_per_node)

    def capacity_bytes(self, device: Device) -> int:
        """GPU capacity is per GPU, CPU and NVMe per node."""
        gb = {"gpu": self.gpu_memory_gb, "cpu": self.cpu_memory_gb, "nvme": self.nvme_gb}[device]
        return round(gb * GB)

    def usable_bytes(self, device: Device) -> int:
        return round(self.capacity_bytes(device) * (1 - self.headroom))


@dataclass(frozen=True)
class OptionEstimate:
    """One (stage, offload) choice: model states per rank by device, the stage-3 gather
    working set per GPU, host and NVMe per node, and the lightest recomputation that fits."""

    stage: int
    offload: Offload
    per_rank: dict[Device, dict[Category, int]]
    gather_bytes: int
    cpu_per_node: int
    nvme_per_node: int
    fitting_modes: tuple[RecomputeMode, ...]
    shortfall: Device | None

    @property
    def fits_with(self) -> RecomputeMode | None:
        """The lightest recomputation that fits, or None when nothing does."""
        return self.fitting_modes[0] if self.fitting_modes else None

    @property
    def label(self) -> str:
        return f"stage {self.stage}" + ("" if self.offload == NO_OFFLOAD else f" + {self.offload.label}")

    @property
    def gpu_model_states(self) -> int:
        return sum(self.per_rank["gpu"].values())

    def gpu_total(self, activations: int) -> int:
        return self.gpu_model_states + self.gather_bytes + activations


@dataclass(frozen=True)
class Recommendation:
    option: OptionEstimate
    recompute: RecomputeMode
    gpu_bytes: int

    @property
    def label(self) -> str:
        recompute = "no recomputation" if self.recompute == "none" else f"{self.recompute} recomputation"
        return f"{self.option.label}, {recompute}"


@dataclass(frozen=True)
class Estimate:
    """Everything `shardwise estimate` prints. `activations` is None when the shape has no
    layout; `recommendation` is None when nothing fits; `ruled_out` lists the options the
    preference order tried before the recommended one."""

    shape: ModelShape
    hardware: Hardware
    micro_batch: int
    seq_len: int
    dtype: str
    optimizer: str
    optimizer_state_bytes: int
    activations: dict[RecomputeMode, int] | None
    options: tuple[OptionEstimate, ...]
    recommendation: Recommendation | None
    ruled_out: tuple[OptionEstimate, ...] = ()
    explanation: tuple[str, ...] = ()

    def option(self, stage: int, offload: Offload = NO_OFFLOAD) -> OptionEstimate:
        for candidate in self.options:
            if candidate.stage == stage and candidate.offload == offload:
                return candidate
        raise KeyError(f"no option stage {stage} with offload {offload.label}")

    def activation(self, recompute: RecomputeMode) -> int:
        return 0 if self.activations is None else self.activations[recompute]


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
