"""`deepspeed.runtime.base_optimizer`: the classes DeepSpeed's optimizer wrappers derive
from, which libraries test against (Lightning's DeepSpeedStrategy.load_checkpoint:
`isinstance(item, (Optimizer, DeepSpeedOptimizer))`).

What `deepspeed.initialize` returns in DeepSpeed 0.19.8 (checked on CPU): at ZeRO stages
1-3 a ZeRO wrapper (`DeepSpeedZeroOptimizer`, `..._Stage3`), a `ZeROOptimizer` and so a
`DeepSpeedOptimizer`; at stage 0 with fp16 or bf16 a mixed-precision wrapper, a
`DeepSpeedOptimizer`; at stage 0 in fp32 the torch optimizer itself, neither.

shardwise returns the torch optimizer over the rank's fp32 partition (init_engine.py), of
its own class, since checkpoints record that class. `initialize` marks it with the
wrapper classes DeepSpeed's would be an instance of (`mark_wrapped`), and these classes
count a marked object as an instance, so the same `isinstance` checks answer as under
DeepSpeed while `type(optimizer)` stays the torch class.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DeepSpeedOptimizer", "ZeROOptimizer", "mark_wrapped"]

_WRAPPED_AS = "_deepspeed_wrapped_as"  # the attribute holding the classes an optimizer stands in for


class _CountsMarkedOptimizers(type):
    def __instancecheck__(cls, instance: Any) -> bool:
        marked = getattr(instance, _WRAPPED_AS, ())
        return type.__instancecheck__(cls, instance) or any(issubclass(wrapper, cls) for wrapper in marked)


class DeepSpeedOptimizer(metaclass=_CountsMarkedOptimizers):
    """DeepSpeed's base of its optimizer wrappers."""


class ZeROOptimizer(DeepSpeedOptimizer):
    """DeepSpeed's base of its ZeRO optimizer wrappers (stages 1-3)."""


def mark_wrapped(optimizer: Any, *, zero_stage: int, mixed_precision: bool) -> None:
    """Make `optimizer` an instance of the wrapper classes DeepSpeed's optimizer at this
    ZeRO stage and precision would be (module docstring); nothing at stage 0 in fp32."""
    if zero_stage > 0:
        setattr(optimizer, _WRAPPED_AS, (ZeROOptimizer,))
    elif mixed_precision:
        setattr(optimizer, _WRAPPED_AS, (DeepSpeedOptimizer,))
