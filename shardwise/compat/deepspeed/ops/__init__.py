"""`deepspeed.ops`: DeepSpeed's optimizer classes by name, on torch's and shardwise's."""

from shardwise.compat.deepspeed.ops import adam, lamb

__all__ = ["adam", "lamb"]
