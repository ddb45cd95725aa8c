"""`deepspeed.ops.op_builder`: the builder classes scripts ask whether an op can be used
(`FusedAdamBuilder().is_compatible()`, `deepspeed.ops.__compatible_ops__[Builder.NAME]`).

DeepSpeed compiles C++/CUDA extensions for these; shardwise has none to compile: each op
a builder names is done by the Python class the builder lists (torch's fused Adam for
`fused_adam` and `cpu_adam`, shardwise's LAMB, shardwise's NVMe store for `async_io`), so
every builder here is compatible and `load()` raises, naming the class to use instead.
"""

from __future__ import annotations

__all__ = ["AsyncIOBuilder", "CPUAdamBuilder", "FusedAdamBuilder", "FusedLambBuilder", "OpBuilder", "compatible_ops"]


class OpBuilder:
    """One DeepSpeed op: its `NAME` (the key of `__compatible_ops__`) and where shardwise does it."""

    NAME = ""
    REPLACEMENT = ""

    def is_compatible(self, verbose: bool = False) -> bool:
        return True

    def absolute_name(self) -> str:
        return f"deepspeed.ops.{self.NAME}_op"

    def load(self, verbose: bool = True):
        raise RuntimeError(f"{type(self).__name__}.load(): shardwise compiles no DeepSpeed extension; the "
                           f"'{self.NAME}' op is {self.REPLACEMENT}: use that instead of the compiled module")


class FusedAdamBuilder(OpBuilder):
    NAME = "fused_adam"
    REPLACEMENT = "deepspeed.ops.adam.FusedAdam (torch's fused Adam)"


class CPUAdamBuilder(OpBuilder):
    NAME = "cpu_adam"
    REPLACEMENT = "deepspeed.ops.adam.DeepSpeedCPUAdam (torch's fused Adam on the host)"


class FusedLambBuilder(OpBuilder):
    NAME = "fused_lamb"
    REPLACEMENT = "deepspeed.ops.lamb.FusedLamb (shardwise's LAMB)"


class AsyncIOBuilder(OpBuilder):
    NAME = "async_io"
    REPLACEMENT = ("shardwise's NVMe store, used through the config's offload_optimizer / offload_param "
                   "{\"device\": \"nvme\"}")


compatible_ops: dict[str, bool] = {builder.NAME: builder().is_compatible()
                                   for builder in (FusedAdamBuilder, CPUAdamBuilder, FusedLambBuilder, AsyncIOBuilder)}
