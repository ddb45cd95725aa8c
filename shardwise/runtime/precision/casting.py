"""Inputs in the compute dtype and on the training device: floating-point tensors in a
forward's arguments are cast, as DeepSpeed's engine does for 16-bit training; integer
tensors (token ids) and anything that is not a tensor pass through, however deeply nested."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from shardwise.runtime.precision.policy import PrecisionPolicy


def cast_floating(value: Any, dtype: torch.dtype) -> Any:
    if dtype == torch.float32:
        return value
    if torch.is_tensor(value):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(cast_floating(item, dtype) for item in value))
    if isinstance(value, (list, tuple)):
        return type(value)(cast_floating(item, dtype) for item in value)
    if isinstance(value, dict):
        return {key: cast_floating(item, dtype) for key, item in value.items()}
    return value


def to_device(value: Any, device: torch.device) -> Any:
    """Every tensor in `value` (a tensor, or tuples and lists of them and other values) on `device`."""
    if torch.is_tensor(value):
        return value.to(device)
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(to_device(item, device) for item in value)
    return value


def cast_unheld_state(model: torch.nn.Module, dtype: torch.dtype, held: set[int]) -> int:
    """Floating-point parameters ZeRO does not hold (frozen ones, by id not in `held`) and
    floating-point buffers (e.g. BatchNorm statistics) take the compute dtype, as DeepSpeed
    casts the whole module. Those parameters stay whole on every rank; returns their bytes
    (counted as parameters)."""
    nbytes = 0
    for param in model.parameters():
        if id(param) not in held and param.is_floating_point():
            param.data = param.data.to(dtype)
            nbytes += param.numel() * param.element_size()
    for module in model.modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer.is_floating_point():
                module._buffers[name] = buffer.to(dtype)
    return nbytes


def autocast_for(policy: PrecisionPolicy, device: torch.device) -> contextlib.AbstractContextManager:
    """`torch.autocast` as the policy asks (DeepSpeed's torch_autocast: the config's dtype,
    or torch's default for the device), else nothing: a caller's own autocast stays in force."""
    if not policy.autocast:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=policy.autocast_dtype)
