"""One kernel per function body: the bodies of shardwise's fused operators, compiled by Inductor.

A fused operator here is an `autograd.Function` whose forward and backward are each a
small pure function of tensors. Eagerly, each body runs as a few torch calls; compiled,
Inductor turns it into one loop over memory (a C++ kernel on CPU, Triton on CUDA), which
is the fusion. The autograd.Function itself is what compiling a whole model does not give:
a backward written by hand that saves fewer tensors (e.g. recomputing an activation instead
of storing it).

Bodies are compiled on first use with `fullgraph=True`. Inside an enclosing `torch.compile`
region the eager body is traced instead (the outer graph fuses it). `kernel_fusion(False)`
runs the eager bodies, as the equivalence tests do to keep Inductor's compile time out of
the fast suite.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable[..., object])

_state = {"enabled": True}


@contextlib.contextmanager
def kernel_fusion(enabled: bool) -> Iterator[None]:
    """Compile fused bodies (True, the default) or run them eagerly (False) inside the block."""
    previous = _state["enabled"]
    _state["enabled"] = enabled
    try:
        yield
    finally:
        _state["enabled"] = previous


def fusion_enabled() -> bool:
    return _state["enabled"]


def fused(body: F) -> F:
    """`body` compiled into one kernel on first use, unless fusion is off or already compiling."""
    compiled: list[Callable] = []

    @functools.wraps(body)
    def run(*args, **kwargs):
        if not _state["enabled"] or torch.compiler.is_compiling():
            return body(*args, **kwargs)
        if not compiled:
            compiled.append(torch.compile(body, fullgraph=True))
        return compiled[0](*args, **kwargs)

    return run  # type: ignore[return-value]
