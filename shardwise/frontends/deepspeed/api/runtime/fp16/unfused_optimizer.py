"""`deepspeed.runtime.fp16.unfused_optimizer`: the class of DeepSpeed's mixed-precision
wrapper around any other torch optimizer, which scripts test `engine.optimizer` against.

DeepSpeed 0.19.8's engine builds an `FP16_UnfusedOptimizer` (a `DeepSpeedOptimizer`) at
ZeRO stage 0 in fp16, or in bf16 outside a pipeline, when the torch optimizer is not its
`FusedAdam` (a script's own optimizer, `torch_adam`, `SGD`, `Lamb`...; checked on CPU in
bf16). shardwise's optimizer is never this class: `deepspeed.initialize` marks it as one
there (runtime/base_optimizer.py).
"""

from __future__ import annotations

from shardwise.frontends.deepspeed.api.runtime.zero.optimizer_classes import DeepSpeedOptimizer

__all__ = ["FP16_UnfusedOptimizer"]


class FP16_UnfusedOptimizer(DeepSpeedOptimizer):  # noqa: N801 (DeepSpeed's name)
    """DeepSpeed's unfused mixed-precision optimizer wrapper, for `isinstance` (module docstring)."""
