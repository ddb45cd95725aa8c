"""`deepspeed.compression`: the attribute helpers LoRA code imports from it (`helper`).
DeepSpeed's compression training itself (`compression_training`) was removed from
DeepSpeed 0.19.8's config, and shardwise refuses that block as DeepSpeed does."""

from shardwise.frontends.deepspeed.api.compression import helper

__all__ = ["helper"]
