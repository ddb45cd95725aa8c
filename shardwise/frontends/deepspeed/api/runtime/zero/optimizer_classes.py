"""The classes of DeepSpeed's optimizer wrappers, which an optimizer `deepspeed.initialize`
returns counts as an instance of where DeepSpeed's would be (runtime/base_optimizer.py
says why and how); `DeepSpeedOptimizer` and `ZeROOptimizer` are exported from
`deepspeed.runtime.base_optimizer`, the ZeRO optimizers from stage_1_and_2.py and stage3.py."""

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


def mark_wrapped(optimizer: Any, wrapper: type[DeepSpeedOptimizer] | None) -> None:
    """Make `optimizer` an instance of `wrapper` (and its bases), the class DeepSpeed's
    optimizer would be (runtime/base_optimizer.py); None where DeepSpeed returns the torch optimizer."""
    if wrapper is not None:
        setattr(optimizer, _WRAPPED_AS, (wrapper,))
