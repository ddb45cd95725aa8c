"""The apply stage's "activation_checkpointing" step, from the config's block.

`activation_checkpointing.policy` (a shardwise key) chooses the recomputation policy for
the model's layer stack; DeepSpeed's keys choose where the kept inputs live
(`partition_activations` over the mesh's tensor group, `cpu_checkpointing`,
`contiguous_memory_optimization` with `number_checkpoints`) and whether region
boundaries synchronise the device and regions are timed (`synchronize_checkpoint_boundary`,
`profile`). DeepSpeed's block alone checkpoints nothing (DeepSpeed's model code calls
`deepspeed.checkpointing.checkpoint` itself); here it also configures that API
(shardwise/frontends/deepspeed/api/checkpointing.py) for scripts that do, unless they configured it themselves.
"""

from __future__ import annotations

import logging

from torch import nn

from shardwise.runtime.activation.apply import apply_activation_checkpointing
from shardwise.runtime.activation.checkpoint import RegionStats
from shardwise.runtime.activation.policy import RecomputePolicy
from shardwise.runtime.activation.store import CheckpointStore
from shardwise.frontends.deepspeed.config import ShardwiseConfig
from shardwise.frontends.deepspeed.config.schema import ActivationCheckpointingConfig
from shardwise.runtime.distributed.collectives import CommStats, Communicator
from shardwise.runtime.distributed.mesh import ParallelMesh
from shardwise.runtime.apply import ModelTransform, register_transform

log = logging.getLogger("shardwise")


def store_from_config(block: ActivationCheckpointingConfig, mesh: ParallelMesh | None) -> CheckpointStore:
    """The checkpoint store the block asks for; Pa splits over `mesh`'s tensor group."""
    partition = None
    if block.partition_activations and mesh is not None and mesh["tensor"].size > 1:
        partition = Communicator(mesh["tensor"], getattr(mesh, "comm_stats", None) or CommStats())
    return CheckpointStore(partition, block.cpu_checkpointing, block.contiguous_memory_optimization,
                           block.number_checkpoints)


def policy_from_config(block: ActivationCheckpointingConfig) -> RecomputePolicy:
    return RecomputePolicy(block.policy, block.every_k)


def _enabled(config: ShardwiseConfig) -> bool:
    return config.activation_checkpointing != ActivationCheckpointingConfig()


def _transform(model: nn.Module, config: ShardwiseConfig, mesh: ParallelMesh) -> nn.Module:
    from shardwise.frontends.deepspeed.api import checkpointing as deepspeed_api

    block = config.activation_checkpointing
    store = store_from_config(block, mesh)
    stats = RegionStats() if block.profile else None
    if not deepspeed_api.is_configured():
        deepspeed_api.configure_store(store, block, stats)
    if block.partition_activations and store.partition is None:
        log.info("shardwise: activation_checkpointing.partition_activations has no effect with a tensor-parallel "
                 "group of one rank (tensor_parallel.size 1): checkpoints are kept whole")
    if block.policy == "none":
        return model
    return apply_activation_checkpointing(model, policy_from_config(block), store=store, stats=stats,
                                          synchronize=block.synchronize_checkpoint_boundary)


register_transform(ModelTransform("activation_checkpointing", _enabled, _transform))
