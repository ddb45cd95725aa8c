"""ZeRO's settings as small policy objects (as FSDP2 passes `MixedPrecisionPolicy`), built
once by a front end (the DeepSpeed config's, or a user in Python) instead of a long
argument list threaded through every class.

Every part of the engine asks the policy the question it cares about (are parameters
partitioned? does the gradient buffer hold the full model?) rather than comparing stage
numbers; what each stage partitions is written once, in shardwise/formulas/stages.py,
which the planner shares.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from shardwise.formulas import stages
from shardwise.runtime.zero.leaf_modules import LeafModulePolicy


@dataclass(frozen=True)
class PrefetchPolicy:
    """Stage 3: what is gathered ahead of use, and what is never partitioned (DeepSpeed's
    defaults)."""

    prefetch_bucket_size: int = 50_000_000
    max_live_parameters: int = 1_000_000_000
    max_reuse_distance: int = 1_000_000_000
    persistence_threshold: int = 100_000


@dataclass(frozen=True)
class OffloadPolicy:
    """Where a kind of model state lives between uses: "none" (the device), "cpu", "nvme"."""

    device: str = "none"
    nvme_path: str | None = None
    pin_memory: bool = False  # page-locked host buffers (with CUDA): asynchronous copies (config/schema.py)
    buffer_count: int = 4
    thread_count: int = 1  # aio.thread_count: threads doing NVMe reads and writes
    block_size: int = 1 << 20  # aio.block_size: bytes per read or write call
    state_tensors: int = 2  # fp32 state tensors per parameter the optimizer will create
    ratio: float = 1.0  # offload_optimizer.ratio: the fraction of the partition offloaded
    buffer_size: int = 100_000_000  # offload_param.buffer_size: elements per NVMe staging buffer
    queue_depth: int = 8  # aio.queue_depth: reads or writes of one region in flight at once

    @property
    def enabled(self) -> bool:
        return self.device != "none"


@dataclass(frozen=True)
class ZeroPlusPlusPolicy:
    """ZeRO++ (Wang et al., 2023; C28): stage 3 sending fewer bytes between nodes.

    qwZ  `quantized_weights`: parameter all-gathers carry int8 with one fp32 scale per
         `weight_block` elements, dequantized on arrival (the masters stay fp32);
    hpZ  `hpz_partition_size` > 1: after a gather from the primary shards each rank keeps
         a secondary partition of the gathered parameters over that many ranks of its node,
         and later gathers until the next update read it, inside the node;
    qgZ  `quantized_gradients`: gradients reduce-scattered by an all-to-all inside the node,
         then one across nodes, carrying int4 with one fp32 scale per `gradient_block`
         elements and summed in fp32 after dequantization.
    """

    quantized_weights: bool = False
    hpz_partition_size: int = 1
    quantized_gradients: bool = False
    weight_block: int = 2048
    gradient_block: int = 512

    def __post_init__(self) -> None:
        if self.hpz_partition_size < 1:
            raise ValueError(f"hpz_partition_size must be at least 1 (1: off), got {self.hpz_partition_size}")
        for name in ("weight_block", "gradient_block"):
            block = getattr(self, name)
            if block < 2 or block % 2:
                raise ValueError(f"{name} must be an even number of elements (int4 packs two per byte), got {block}")

    @property
    def enabled(self) -> bool:
        return self.quantized_weights or self.hpz_partition_size > 1 or self.quantized_gradients


@dataclass(frozen=True)
class ZenFlowPolicy:
    """ZenFlow (Lan et al., 2025, "ZenFlow: Enabling Stall-Free Offloading Training via
    Asynchronous Updates"), as DeepSpeed 0.19.8 runs it: with the
    optimizer offloaded to the CPU, the `topk_ratio` columns of each 2-D weight whose
    gradient is largest (and every 1-D parameter) are updated on the device every step by
    a selective AdamW; every gradient accumulates on the host and the CPU optimizer applies
    the sum every `update_interval` steps. Columns are chosen again every
    `select_interval_steps`, or every `select_interval_epochs` epochs of the training data
    once its length is known (neither: only once, after warm-up); the first
    `full_warm_up_rounds` steps are ordinary offloaded steps (runtime/zero/zenflow.py).
    `update_interval` "auto" is DeepSpeed 0.19.8's adaptive interval as it runs: the CPU
    updates at warm-up and at every selection boundary only (its "need update" flag is read
    after it is cleared, so it never fires), and the loss is not divided (DeepSpeed divides
    by its accumulation count, which "auto" sets to 0). `overlap_step` runs the CPU update
    on a background thread and applies it one update later (runtime/zero/zenflow_overlap.py)."""

    topk_ratio: float = 0.1
    update_interval: int | Literal["auto"] = 1
    select_interval_steps: int = 0
    select_interval_epochs: int = 0
    full_warm_up_rounds: int = 0
    overlap_step: bool = False

    def __post_init__(self) -> None:
        if not 0.0 < self.topk_ratio < 1.0:
            raise ValueError(f"zenflow topk_ratio must be in (0, 1), got {self.topk_ratio}")
        if self.update_interval != "auto" and self.update_interval < 1:
            raise ValueError(f"zenflow update_interval must be at least 1 or \"auto\", got {self.update_interval}")
        if min(self.select_interval_steps, self.select_interval_epochs, self.full_warm_up_rounds) < 0:
            raise ValueError("zenflow select intervals and full_warm_up_rounds must not be negative, got "
                             f"{self.select_interval_steps}, {self.select_interval_epochs} and "
                             f"{self.full_warm_up_rounds}")
        if self.select_interval_steps and self.select_interval_epochs:
            raise ValueError("zenflow selects by steps or by epochs, not both")
        if (self.select_interval_steps and self.update_interval != "auto"
                and self.select_interval_steps < self.update_interval):
            raise ValueError(f"zenflow select interval ({self.select_interval_steps} steps) must be at least "
                             f"update_interval ({self.update_interval}), as DeepSpeed requires: the columns "
                             "updated on the device change only at an update")


@dataclass(frozen=True)
class ZeroPolicy:
    """What ZeRO partitions and how it moves it. Stage 0 is data parallelism: nothing
    partitioned, gradients all-reduced (docs/formulas.md#model-states-per-rank)."""

    stage: int = 0
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    overlap_comm: bool = False
    reduce_scatter: bool = True
    sub_group_size: int = 1_000_000_000  # elements the optimizer steps at once; 0: one flat unit's piece
    prefetch: PrefetchPolicy = field(default_factory=PrefetchPolicy)
    offload_optimizer: OffloadPolicy = OffloadPolicy()
    offload_param: OffloadPolicy = OffloadPolicy()
    shard_size: int | None = None  # hybrid sharding (MiCS / HSDP): ranks per shard group; None: all data ranks
    gather_16bit_weights_on_save: bool = False  # stage 3: a whole 16-bit model may be gathered to save it
    plus_plus: ZeroPlusPlusPolicy = ZeroPlusPlusPolicy()  # ZeRO++ (stage 3)
    leaf_modules: LeafModulePolicy = LeafModulePolicy()  # stage 3: modules gathered whole (leaf_modules.py)
    zenflow: ZenFlowPolicy | None = None  # stall-free offloading (stages 1-3, optimizer on the CPU)
    # step() raises when a trainable parameter got no gradient in the accumulation window on
    # any rank (False: its gradient counts as zero, as plain PyTorch's optimizers skip it)
    refuse_unused_parameters: bool = False
    # gradients summed over the data-parallel ranks instead of averaged (DeepSpeed's
    # gradient_allreduce_op "sum"): N times the mean over N ranks
    sum_gradients: bool = False

    def __post_init__(self) -> None:
        stages.check_stage(self.stage)
        if self.shard_size is not None and self.shard_size < 1:
            raise ValueError(f"shard_size must be at least 1, got {self.shard_size}")
        if self.sub_group_size < 0:
            raise ValueError(f"sub_group_size must be a number of elements (0: one flat unit's piece at a time), "
                             f"got {self.sub_group_size}")
        if self.plus_plus.enabled:
            self._check_plus_plus()
        if self.zenflow is not None:
            self._check_zenflow()

    def _check_zenflow(self) -> None:
        if self.offload_optimizer.device != "cpu":
            raise ValueError("ZenFlow needs the optimizer offloaded to the CPU (DeepSpeed: \"Zenflow must be used "
                             "with cpu offload\"): set zero_optimization.offload_optimizer.device to \"cpu\"")
        if self.stage not in (1, 2, 3):
            raise ValueError(f"ZenFlow runs at ZeRO stages 1 to 3 (it splits the optimizer's update); got stage "
                             f"{self.stage}: use stage 2 or 3")

    def _check_plus_plus(self) -> None:
        if not self.partitions_parameters:
            raise ValueError(f"ZeRO++ (quantized weights, hpZ, quantized gradients) works on stage 3's parameter "
                             f"gathers and gradient reduce-scatters; stage {self.stage} has neither: use stage 3")
        if self.shard_size is not None:
            raise ValueError("ZeRO++ with hybrid sharding (shard_size, mics_shard_size) is not supported: both keep "
                             "traffic inside a node in their own way; use one of them")
        if self.plus_plus.hpz_partition_size > 1 and self.offload_param.enabled:
            raise ValueError("hpZ (hpz_partition_size > 1) with offloaded parameters is not supported: the "
                             "secondary partition lives on the device, which parameter offload empties; use one")

    @property
    def partitions_parameters(self) -> bool:
        """Stage 3: each rank stores 1/N of the 16-bit parameters and gathers on use."""
        return stages.partitions_parameters(self.stage)

    @property
    def keeps_full_gradients(self) -> bool:
        """Stages 0-1 accumulate the whole model's gradient and reduce at the boundary;
        stages 2-3 keep only their partition, so they reduce every micro-batch."""
        return stages.keeps_full_gradients(self.stage)

    @property
    def partitions_model_states(self) -> bool:
        """Stages 1-3 shard optimizer state (and more) over the shard group; stage 0 shards nothing."""
        return stages.partitions_optimizer(self.stage)
