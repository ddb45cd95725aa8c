"""`deepspeed.ops`: DeepSpeed's optimizer classes by name, on torch's and shardwise's, its
block-sparse attention, and `__compatible_ops__`, which ops can be used (op_builder.py)."""

from shardwise.frontends.deepspeed.api.ops import adagrad, adam, aio, lamb, lion, op_builder, sparse_attention
from shardwise.frontends.deepspeed.api.ops.op_builder import compatible_ops as __compatible_ops__

__all__ = ["__compatible_ops__", "adagrad", "adam", "aio", "lamb", "lion", "op_builder", "sparse_attention"]
