"""`deepspeed.runtime.activation_checkpointing.checkpointing`, the module DeepSpeed also
exports as `deepspeed.checkpointing`."""

from shardwise.frontends.deepspeed.checkpointing import (
    checkpoint,
    configure,
    get_cuda_rng_tracker,
    is_configured,
    model_parallel_cuda_manual_seed,
    non_reentrant_checkpoint,
    reset,
)

__all__ = ["checkpoint", "configure", "get_cuda_rng_tracker", "is_configured", "model_parallel_cuda_manual_seed",
           "non_reentrant_checkpoint", "reset"]
