"""`deepspeed.runtime.bf16_optimizer`: the class of DeepSpeed's bf16 optimizer wrapper,
which scripts test `engine.optimizer` against to know whether the engine keeps fp32
master weights beside bf16 ones.

DeepSpeed 0.19.8's engine builds a `BF16_Optimizer` (a `ZeROOptimizer`) at ZeRO stage 1
in bf16 accumulating gradients in fp32 (`data_types.grad_accum_dtype`) with the optimizer
not offloaded, and at stage 0 in bf16 for a `PipelineModule` (checked on CPU). shardwise's
optimizer is never this class: `deepspeed.initialize` marks it as one there
(runtime/base_optimizer.py says how), so `isinstance` answers as under DeepSpeed.
"""

from __future__ import annotations

from shardwise.frontends.deepspeed.api.runtime.zero.optimizer_classes import ZeROOptimizer

__all__ = ["BF16_Optimizer"]


class BF16_Optimizer(ZeROOptimizer):  # noqa: N801 (DeepSpeed's name)
    """DeepSpeed's bf16 optimizer wrapper, for `isinstance` (module docstring)."""
