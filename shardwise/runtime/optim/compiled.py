"""Opt-in `torch.compile` of optimizer step kernels.

Written in torch operations, an optimizer's per-tensor arithmetic makes one pass over
memory per operation (Adam's is about ten, 8-bit Adam's over thirty), where torch's fused
AdamW makes one. Compiled by Inductor, the same function becomes one loop (C++ on a CPU,
Triton on a GPU) that reads and writes each array once, which is what brings these
optimizers near fused AdamW's time per element.

Compiling costs time once per process (tens of seconds on a loaded CPU with an empty
cache, a few with Inductor's on-disk cache warm), so it is off unless an optimizer is
built with `compile=True` (config: `"params": {"compile": true}`): short runs and the
test suite keep the eager functions, which compute the same thing. Kernels are compiled
with dynamic shapes, once per function per process, whatever the tensors' sizes; scalars
(learning rate, bias corrections) are traced as symbols, so schedules do not recompile.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import torch

Kernel = TypeVar("Kernel", bound=Callable)
_COMPILED: dict[Callable, Callable] = {}
# Smaller tensors (biases, norms' gains) take the eager function: for them a compiled loop
# saves nothing, and their ranks and sizes of 0 and 1 would each need a kernel of their own
# (Dynamo specialises on both; past 8 per function it stops compiling).
MIN_COMPILED_NUMEL = 4096


def kernel(function: Kernel, compile: bool, tensor: torch.Tensor | None = None) -> Kernel:
    """`function` itself, or its compiled form (shared by every optimizer in the process)
    where `compile` is set and `tensor`, if given, has at least MIN_COMPILED_NUMEL elements."""
    if not compile or (tensor is not None and tensor.numel() < MIN_COMPILED_NUMEL):
        return function
    if function not in _COMPILED:
        _COMPILED[function] = torch.compile(function, dynamic=True)
    return _COMPILED[function]  # type: ignore[return-value]
