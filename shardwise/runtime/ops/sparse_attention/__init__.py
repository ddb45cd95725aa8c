"""Block-sparse attention with DeepSpeed's names (`deepspeed.ops.sparse_attention`)."""

from shardwise.runtime.ops.sparse_attention.sparse_self_attention import SparseSelfAttention, seeded_layout
from shardwise.runtime.ops.sparse_attention.sparsity_config import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    SparsityConfig,
    VariableSparsityConfig,
)

__all__ = [
    "BSLongformerSparsityConfig",
    "BigBirdSparsityConfig",
    "DenseSparsityConfig",
    "FixedSparsityConfig",
    "LocalSlidingWindowSparsityConfig",
    "SparseSelfAttention",
    "SparsityConfig",
    "VariableSparsityConfig",
    "seeded_layout",
]
