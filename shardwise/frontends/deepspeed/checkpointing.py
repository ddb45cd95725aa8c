"""DeepSpeed's `deepspeed.checkpointing` API over shardwise's checkpoint machinery.

Megatron-style model code checkpoints its own layers: it calls `configure(mpu, ...)` once,
then `checkpoint(layer_fn, *inputs)` in its forward, and seeds tensor-parallel dropout
with `model_parallel_cuda_manual_seed` / `get_cuda_rng_tracker().fork()`. These functions
keep DeepSpeed's names and arguments; the work is `run_checkpointed` (checkpoint.py), so
Pa, CPU checkpoints and the contiguous buffer behave as with the config's policy, RNG
states (named ones included) are replayed, and the bytes are counted by the engine.

Differences from DeepSpeed, all relaxations: CPU checkpointing and the contiguous buffer
work without Pa, the contiguous buffer without `num_checkpoints` (it learns the size in
the first step), and inputs that do not require grad are fine (the checkpoint is
non-reentrant). When the script configures nothing, `shardwise.initialize` configures
this module from the config's `activation_checkpointing` block and the mesh.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable

import torch.distributed as dist

from shardwise.runtime.activation.checkpoint import RegionStats, run_checkpointed
from shardwise.runtime.activation.rng import MODEL_PARALLEL_RNG, RNGStatesTracker, manual_seed, rng_tracker
from shardwise.runtime.activation.store import CheckpointStore
from shardwise.frontends.deepspeed.config.schema import ActivationCheckpointingConfig, ShardwiseConfig
from shardwise.runtime.distributed.collectives import Communicator
from shardwise.runtime.distributed.mesh import GroupHandle

# Megatron's offset between the data-parallel seed and the tensor-parallel streams' seeds,
# kept so that scripts seeded the same way draw the same masks as under DeepSpeed.
TENSOR_PARALLEL_SEED_OFFSET = 2718


class _Settings:
    def __init__(self) -> None:
        self.configured = False
        self.store = CheckpointStore()
        self.block = ActivationCheckpointingConfig()
        self.stats: RegionStats | None = None
        self.tensor_rank = 0


_settings = _Settings()


def configure(
    mpu_: Any = None,
    deepspeed_config: str | os.PathLike | dict | ShardwiseConfig | None = None,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
) -> None:
    """DeepSpeed's `configure`: settings from the config's `activation_checkpointing`
    block, overridden by the arguments given; Pa splits over `mpu_`'s tensor-parallel group
    (`get_tensor_model_parallel_group()` or `get_model_parallel_group()`)."""
    block = _block_of(deepspeed_config).model_dump()
    overrides = {
        "partition_activations": partition_activations, "contiguous_memory_optimization": contiguous_checkpointing,
        "number_checkpoints": num_checkpoints, "cpu_checkpointing": checkpoint_in_cpu,
        "synchronize_checkpoint_boundary": synchronize, "profile": profile,
    }
    block.update({key: value for key, value in overrides.items() if value is not None})
    block = ActivationCheckpointingConfig(**block)
    group = _tensor_group(mpu_)
    partition = group if block.partition_activations else None
    store = CheckpointStore(partition, block.cpu_checkpointing, block.contiguous_memory_optimization,
                            block.number_checkpoints)
    configure_store(store, block, RegionStats() if block.profile else None)
    _settings.tensor_rank = group.rank if group is not None else 0


def configure_store(store: CheckpointStore, block: ActivationCheckpointingConfig, stats: RegionStats | None) -> None:
    """Use `store` for `checkpoint()` calls (shardwise.initialize calls this from the config)."""
    _settings.store, _settings.block, _settings.stats = store, block, stats
    _settings.tensor_rank = store.partition.rank if store.partition is not None else 0
    _settings.configured = True


def is_configured() -> bool:
    return _settings.configured


def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`function(*args, **kwargs)` with its activations recomputed in backward."""
    return run_checkpointed(function, args, kwargs, _settings.store, stats=_settings.stats,
                            synchronize=_settings.block.synchronize_checkpoint_boundary)


non_reentrant_checkpoint = checkpoint


def checkpoint_stats() -> RegionStats | None:
    """Forward and recomputation seconds of `checkpoint()` calls, with `profile` on."""
    return _settings.stats


def reset() -> None:
    """DeepSpeed's `reset`: drop the contiguous buffers (e.g. after evaluation forwards
    that never ran a backward); the next step allocates them again."""
    _settings.store.arenas.clear()


def get_cuda_rng_tracker() -> RNGStatesTracker:
    return rng_tracker()


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Seed the default stream with `seed` (equal on every tensor rank) and add the
    tensor-parallel stream, seeded differently per tensor rank."""
    tracker = rng_tracker()
    tracker.reset()
    manual_seed(seed)
    tracker.add(MODEL_PARALLEL_RNG, seed + TENSOR_PARALLEL_SEED_OFFSET + _settings.tensor_rank)


def _block_of(config: str | os.PathLike | dict | ShardwiseConfig | None) -> ActivationCheckpointingConfig:
    """The block of a config given as a path, a dict, or an engine's loaded `engine.config`
    (DeepSpeed's pipeline tests pass `deepspeed_config=engine.config`)."""
    if config is None:
        return ActivationCheckpointingConfig()
    if isinstance(config, ShardwiseConfig):
        return config.activation_checkpointing
    if not isinstance(config, dict):
        with open(config, encoding="utf-8") as handle:
            config = json.load(handle)
    return ActivationCheckpointingConfig(**config.get("activation_checkpointing", {}))


def _tensor_group(mpu: Any) -> Communicator | None:
    if mpu is None:
        return None
    if hasattr(mpu, "get_tensor_model_parallel_group"):
        group = mpu.get_tensor_model_parallel_group()
    else:
        group = mpu.get_model_parallel_group()
    ranks = tuple(dist.get_process_group_ranks(group))
    return Communicator(GroupHandle("tensor", ranks, dist.get_rank(group), group, None))
