"""`deepspeed.ops.sparse_attention`: DeepSpeed's block-sparse attention classes, on
shardwise's (shardwise/runtime/ops/sparse_attention/: the same layouts, a CPU block-sparse kernel,
flex_attention block masks on CUDA)."""

from shardwise.runtime.ops.sparse_attention import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    SparseSelfAttention,
    SparsityConfig,
    VariableSparsityConfig,
)

__all__ = ["BSLongformerSparsityConfig", "BigBirdSparsityConfig", "DenseSparsityConfig", "FixedSparsityConfig",
           "LocalSlidingWindowSparsityConfig", "SparseSelfAttention", "SparsityConfig", "VariableSparsityConfig"]
