"""ZeRO's settings as small policy objects (as FSDP2 passes `MixedPrecisionPolicy`), built
once from the config, instead of a long argument list threaded through every class.

The stage number is read in exactly one place, here: every part of the engine asks the
policy the question it cares about (are parameters partitioned? does the gradient buffer
hold the full model?) rather than comparing stage numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardwise.formulas import stages
from shardwise.frontends.deepspeed.config import ShardwiseConfig
from shardwise.runtime.optim.registry import optimizer_spec

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class PrefetchPolicy:
    """Stage 3: what is gathered ahead of use, and what is never partitioned."""

    prefetch_bucket_size: int
    max_live_parameters: int
    max_reuse_distance: int
    persistence_threshold: int


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
    stage: int
    param_dtype: torch.dtype  # compute dtype of parameters and gradients
    reduce_dtype: torch.dtype  # dtype gradients are communicated in
    reduce_bucket_size: int
    allgather_bucket_size: int
    overlap_comm: bool
    reduce_scatter: bool
    sub_group_size: int
    prefetch: PrefetchPolicy
    offload_optimizer: OffloadPolicy = OffloadPolicy()
    offload_param: OffloadPolicy = OffloadPolicy()

    @classmethod
    def from_config(cls, config: ShardwiseConfig) -> "ZeroPolicy":
        zero = config.zero_optimization
        dtype = compute_dtype(config)
        reduce_dtype = DTYPES[config.communication_data_type] if config.communication_data_type else dtype
        return cls(
            stage=zero.stage,
            param_dtype=dtype,
            reduce_dtype=reduce_dtype,
            reduce_bucket_size=zero.reduce_bucket_size,
            allgather_bucket_size=zero.allgather_bucket_size,
            overlap_comm=bool(zero.overlap_comm),
            reduce_scatter=zero.reduce_scatter,
            sub_group_size=zero.sub_group_size,
            prefetch=PrefetchPolicy(
                zero.stage3_prefetch_bucket_size,
                zero.stage3_max_live_parameters,
                zero.stage3_max_reuse_distance,
                zero.stage3_param_persistence_threshold,
            ),
            offload_optimizer=_offload(zero.offload_optimizer, config),
            offload_param=_offload(zero.offload_param, config),
        )

    @property
    def partitions_parameters(self) -> bool:
        """Stage 3: each rank stores 1/N of the 16-bit parameters and gathers on use."""
        return stages.partitions_parameters(self.stage)

    @property
    def keeps_full_gradients(self) -> bool:
        """Stages 0-1 accumulate the whole model's gradient and reduce at the boundary;
        stages 2-3 keep only their partition, so they reduce every micro-batch."""
        return stages.keeps_full_gradients(self.stage)


def _offload(section, config: ShardwiseConfig) -> OffloadPolicy:
    aio = config.aio
    optimizer = config.optimizer
    states = optimizer_spec(optimizer.type).fp32_states(optimizer.params) if optimizer is not None else 2
    defaults = OffloadPolicy()
    return OffloadPolicy(
        section.device, section.nvme_path, section.pin_memory, section.buffer_count,
        aio.thread_count if aio else defaults.thread_count, aio.block_size if aio else defaults.block_size, states,
        getattr(section, "ratio", defaults.ratio), getattr(section, "buffer_size", defaults.buffer_size),
        aio.queue_depth if aio else defaults.queue_depth,
    )


def compute_dtype(config: ShardwiseConfig) -> torch.dtype:
    if config.bf16.enabled:
        return torch.bfloat16
    if config.fp16.enabled:
        return torch.float16
    return torch.float32
