"""What an estimate is made of: the hardware it is for, each (stage, offload) option
evaluated, and the recommendation. Kept apart from recommend.py (which computes them) and
explain.py (which prints their arithmetic), so neither imports the other."""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil

from shardwise.formulas.memory import GB, NO_OFFLOAD, Category, Device, Offload, RecomputeMode
from shardwise.formulas.parallel_activation import NO_MODEL_PARALLEL, ModelParallel
from shardwise.formulas.model_shape import ModelShape

DEFAULT_HEADROOM = 0.15


@dataclass(frozen=True)
class Hardware:
    """The cluster. `num_gpus` is every GPU of the job: the data-parallel size N, or N·T
    with a tensor group of T (`ModelParallel`).
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
    parallel: ModelParallel = NO_MODEL_PARALLEL
    params_per_rank: int = 0  # Ψ of one tensor rank's shard (Ψ without tensor parallelism); trained ones only
    frozen_per_rank: int = 0  # Ψ_f: frozen parameters of that shard (b bytes each, no other state)
    tensor_suggestion: "Estimate | None" = None  # the smallest T that fits without offload, when ZeRO alone does not
    bf16_masters: bool = False  # bf16 masters and optimizer states: K counts 2-byte states, no master, no offload
    grad_accum_dtype: str | None = None  # "fp32": 4-byte gradient buffers beside 16-bit training (stages 1-3)

    @property
    def zero_ranks(self) -> int:
        """N: the ranks ZeRO shards over (data × Ulysses sequence ranks) = GPUs / (T·P)."""
        return self.hardware.num_gpus // (self.parallel.tensor * self.parallel.pipeline)

    def option(self, stage: int, offload: Offload = NO_OFFLOAD) -> OptionEstimate:
        for candidate in self.options:
            if candidate.stage == stage and candidate.offload == offload:
                return candidate
        raise KeyError(f"no option stage {stage} with offload {offload.label}")

    def activation(self, recompute: RecomputeMode) -> int:
        return 0 if self.activations is None else self.activations[recompute]
