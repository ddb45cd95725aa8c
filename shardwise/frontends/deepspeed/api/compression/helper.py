"""`deepspeed.compression.helper`: reaching a submodule by its dotted name, which
DeepSpeed-Chat's LoRA conversion uses to swap linear layers in place."""

from __future__ import annotations

from typing import Any

__all__ = ["recursive_getattr", "recursive_setattr"]


def recursive_getattr(model: Any, module_name: str) -> Any:
    """`model.a.b.c` for `module_name` "a.b.c"."""
    target = model
    for name in module_name.split("."):
        target = getattr(target, name)
    return target


def recursive_setattr(model: Any, module_name: str, module: Any) -> None:
    """Set `model.a.b.c = module` for `module_name` "a.b.c"."""
    parent_name, _, name = module_name.rpartition(".")
    setattr(recursive_getattr(model, parent_name) if parent_name else model, name, module)
