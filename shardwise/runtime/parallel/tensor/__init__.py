"""Tensor parallelism (Megatron): layers holding local shards, vocabulary-parallel
embedding and loss, styles a plan gives modules, and `apply_tensor_parallel`."""

from shardwise.runtime.parallel.tensor.cross_entropy import VocabShardedLogits, causal_lm_loss, vocab_parallel_cross_entropy
from shardwise.runtime.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorRegion,
    VocabParallelEmbedding,
    VocabParallelHead,
)
from shardwise.runtime.parallel.tensor.placement import TensorShard, gather_full, is_tensor_sharded, tensor_shard
from shardwise.runtime.parallel.tensor.plans import TensorPlan
from shardwise.runtime.parallel.tensor.policy import TensorPolicy
from shardwise.runtime.parallel.tensor.styles import STYLES
from shardwise.runtime.parallel.tensor.transform import apply_tensor_parallel

__all__ = [
    "STYLES", "ColumnParallelLinear", "RowParallelLinear", "TensorPlan", "TensorPolicy", "TensorRegion", "TensorShard",
    "VocabParallelEmbedding",
    "VocabParallelHead", "VocabShardedLogits", "apply_tensor_parallel", "causal_lm_loss", "gather_full",
    "is_tensor_sharded", "tensor_shard", "vocab_parallel_cross_entropy",
]
