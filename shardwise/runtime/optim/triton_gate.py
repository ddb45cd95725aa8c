"""Whether LAMB and 8-bit Adam step a tensor with their Triton kernels
(optim/triton_kernels.py): tensors on a GPU, Triton installed, and
`SHARDWISE_TRITON_OPTIM` not 0. Without Triton the optimizers take their torch path on
the GPU, warned about once.

Under Triton's interpreter (`TRITON_INTERPRET=1`, a whole process's setting) CPU tensors
are taken too: the test suite runs the kernels that way, in a process of their own, on
machines without a GPU (CPU training otherwise takes the native kernels, optim/native.py,
which the optimizers try first).
"""

from __future__ import annotations

import functools
import importlib
import os
import warnings
from types import ModuleType

import torch

ENABLE_VARIABLE = "SHARDWISE_TRITON_OPTIM"


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter: set before Triton is first
    imported (Triton fixes its own functions' mode then), so for a whole process."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def takes(*tensors: torch.Tensor) -> bool:
    """Whether the kernels step these tensors in place: contiguous fp32 on a GPU (or on the
    CPU under the interpreter), Triton importable, the kernels not turned off."""
    if os.environ.get(ENABLE_VARIABLE, "1") == "0":
        return False
    if not all(t.dtype == torch.float32 and t.is_contiguous() for t in tensors):
        return False
    if not all(t.is_cuda or (interpreting() and t.is_cpu) for t in tensors):
        return False
    return kernels() is not None


@functools.cache
def kernels() -> ModuleType | None:
    """optim/triton_kernels.py, imported on first use (None, warned once, without Triton)."""
    try:
        return importlib.import_module("shardwise.runtime.optim.triton_kernels")
    except ImportError as error:
        warnings.warn(f"Triton cannot be imported ({error}): LAMB and 8-bit Adam take their torch path on the "
                      "GPU, several passes over memory per step; `pip install triton` for the one-pass kernels",
                      stacklevel=3)
        return None
