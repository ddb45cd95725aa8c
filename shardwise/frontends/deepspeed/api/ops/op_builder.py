"""`deepspeed.ops.op_builder`: the builder classes scripts ask whether an op can be used
(`FusedAdamBuilder().is_compatible()`, `deepspeed.ops.__compatible_ops__[Builder.NAME]`).

DeepSpeed compiles C++/CUDA extensions for these; shardwise has none to compile: each op
a builder names is done by the Python class the builder lists (torch's fused Adam for
`fused_adam` and `cpu_adam`, shardwise's LAMB, shardwise's NVMe store for `async_io`), so
every builder here is compatible and `load()` raises, naming the class to use instead.
"""

from __future__ import annotations

__all__ = ["AsyncIOBuilder", "CPUAdagradBuilder", "CPUAdamBuilder", "CPULionBuilder", "FusedAdamBuilder",
           "FusedLambBuilder", "FusedLionBuilder", "NotImplementedBuilder", "OpBuilder", "builder_named",
           "compatible_ops"]


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


class CPUAdagradBuilder(OpBuilder):
    NAME = "cpu_adagrad"
    REPLACEMENT = "deepspeed.ops.adagrad.DeepSpeedCPUAdagrad (torch's Adagrad on the host)"


class CPULionBuilder(OpBuilder):
    NAME = "cpu_lion"
    REPLACEMENT = "deepspeed.ops.lion.DeepSpeedCPULion (shardwise's Lion)"


class FusedLionBuilder(OpBuilder):
    NAME = "fused_lion"
    REPLACEMENT = "deepspeed.ops.lion.FusedLion (shardwise's Lion)"


class AsyncIOBuilder(OpBuilder):
    NAME = "async_io"
    REPLACEMENT = ("shardwise's NVMe store, used through the config's offload_optimizer / offload_param "
                   "{\"device\": \"nvme\"}")


class NotImplementedBuilder(OpBuilder):
    """What DeepSpeed's accelerators hand out for an op they have no builder for (their
    `get_op_builder`): as DeepSpeed's, it says it is compatible and fails to load."""

    NAME = "deepspeed_not_implemented"

    def absolute_name(self) -> str:
        return f"deepspeed.ops.comm.{self.NAME}_op"

    def load(self, verbose: bool = True):
        raise ValueError("This op had not been implemented on this accelerator (shardwise lists the ops it does "
                         "in deepspeed.ops.__compatible_ops__)")


BUILDERS = (FusedAdamBuilder, CPUAdamBuilder, FusedLambBuilder, CPUAdagradBuilder, CPULionBuilder, FusedLionBuilder,
            AsyncIOBuilder)


def builder_named(class_name: str) -> type[OpBuilder]:
    """The builder class `class_name` names (`get_accelerator().get_op_builder`), or
    `NotImplementedBuilder` for one shardwise does not list."""
    return next((builder for builder in BUILDERS if builder.__name__ == class_name), NotImplementedBuilder)


compatible_ops: dict[str, bool] = {builder.NAME: builder().is_compatible() for builder in BUILDERS}
