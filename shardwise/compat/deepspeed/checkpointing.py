"""`deepspeed.checkpointing`: DeepSpeed's activation-checkpointing API, on shardwise's
(shardwise/activation/deepspeed_api.py: the config's activation_checkpointing block,
partitioned and CPU checkpoints, RNG replay on recompute)."""

from shardwise.activation.deepspeed_api import (
    checkpoint,
    configure,
    get_cuda_rng_tracker,
    is_configured,
    model_parallel_cuda_manual_seed,
    reset,
)

__all__ = ["checkpoint", "configure", "get_cuda_rng_tracker", "is_configured", "model_parallel_cuda_manual_seed",
           "reset"]
