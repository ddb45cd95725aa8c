"""`deepspeed.ops.aio`: the asynchronous-I/O op's builder, which scripts check before
offloading to NVMe (api/ops/op_builder.py)."""

from shardwise.frontends.deepspeed.api.ops.op_builder import AsyncIOBuilder

__all__ = ["AsyncIOBuilder"]
