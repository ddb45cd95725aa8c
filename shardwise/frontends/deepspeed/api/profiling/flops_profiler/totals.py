"""A module's profile numbers with its submodules': what DeepSpeed's `get_module_*`
functions return, and what the printed profile shows per module."""

from __future__ import annotations

from torch import nn

__all__ = ["get_module_duration", "get_module_flops", "get_module_macs"]


def get_module_flops(module: nn.Module) -> int:
    """The floating-point operations of `module`'s forwards, its submodules' included."""
    return sum(m.__flops__ for m in module.modules())


def get_module_macs(module: nn.Module) -> int:
    return sum(m.__macs__ for m in module.modules())


def get_module_duration(module: nn.Module) -> float:
    """The module's forward time; a module never called itself (a ModuleList) sums its children's."""
    duration = module.__duration__
    if duration == 0:
        duration = sum(get_module_duration(child) for child in module.children())
    return duration
