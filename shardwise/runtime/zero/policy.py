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

from shardwise.formulas import stages


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
class ZeroPolicy:
    """What ZeRO partitions and how it moves it. Stage 0 is data parallelism: nothing
    partitioned, gradients all-reduced (docs/formulas.md#model-states-per-rank)."""

    stage: int = 0
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    overlap_comm: bool = False
    reduce_scatter: bool = True
    sub_group_size: int = 1_000_000_000
    prefetch: PrefetchPolicy = field(default_factory=PrefetchPolicy)
    offload_optimizer: OffloadPolicy = OffloadPolicy()
    offload_param: OffloadPolicy = OffloadPolicy()
    shard_size: int | None = None  # hybrid sharding (MiCS / HSDP): ranks per shard group; None: all data ranks
    gather_16bit_weights_on_save: bool = False  # stage 3: a whole 16-bit model may be gathered to save it

    def __post_init__(self) -> None:
        stages.check_stage(self.stage)
        if self.shard_size is not None and self.shard_size < 1:
            raise ValueError(f"shard_size must be at least 1, got {self.shard_size}")

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
