"""`deepspeed.ops`: DeepSpeed's optimizer classes by name, on torch's and shardwise's, and
its block-sparse attention."""

from shardwise.frontends.deepspeed.api.ops import adam, lamb, sparse_attention

__all__ = ["adam", "lamb", "sparse_attention"]
