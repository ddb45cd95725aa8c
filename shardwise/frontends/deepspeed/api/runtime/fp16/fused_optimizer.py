"""`deepspeed.runtime.fp16.fused_optimizer`: the class of DeepSpeed's mixed-precision
wrapper around its fused Adam, which scripts test `engine.optimizer` against.

DeepSpeed 0.19.8's engine builds an `FP16_Optimizer` (a `DeepSpeedOptimizer`, not a
`ZeROOptimizer`) at ZeRO stage 0 in fp16, or in bf16 outside a pipeline, when the torch
optimizer is its `FusedAdam`: the config's `Adam` / `AdamW` without `torch_adam`, or a
`deepspeed.ops.adam.FusedAdam` the script passes (checked on CPU in bf16; fp16 takes the
same branch of `_configure_fp16_optimizer`, which a CPU cannot run). shardwise's optimizer
is never this class: `deepspeed.initialize` marks it as one there (runtime/base_optimizer.py).
"""

from __future__ import annotations

from shardwise.frontends.deepspeed.api.runtime.zero.optimizer_classes import DeepSpeedOptimizer

__all__ = ["FP16_Optimizer"]


class FP16_Optimizer(DeepSpeedOptimizer):  # noqa: N801 (DeepSpeed's name)
    """DeepSpeed's fused mixed-precision optimizer wrapper, for `isinstance` (module docstring)."""
