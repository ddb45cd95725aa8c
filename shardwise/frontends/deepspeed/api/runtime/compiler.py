"""`deepspeed.runtime.compiler`: the helpers model code uses to keep parts of itself out of
`torch.compile` (`@disable`, `is_compiling()`), as DeepSpeed 0.19.8 names them, over
torch's own compiler API. DeepSpeed's `compile_autoep_non_moe_regions` (regional
compilation around its AutoEP layers) is not provided: shardwise has no AutoEP layer.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import torch

from shardwise.frontends.deepspeed.api.utils.torch import required_torch_version

__all__ = ["compile", "compiled_autograd", "disable", "dummy_decorator", "enable", "is_compile_supported",
           "is_compiling", "lazy_disable"]

COMPILE_BACKEND = "inductor"  # DeepSpeed's accelerators' compile backend on CUDA and the CPU


def is_compile_supported() -> bool:
    """torch.compile is there (torch >= 2.1; always, with the torch shardwise runs on)."""
    return required_torch_version(min_version=2.1)


def is_compiling() -> bool:
    """Whether the caller is being traced by torch.compile (dynamo)."""
    return torch.compiler.is_compiling()


def disable(func: Callable) -> Callable:
    """`func`, run eagerly even when called from compiled code (a graph break around it)."""
    return torch.compiler.disable(func)


def lazy_disable(func: Callable) -> Callable:
    """`disable`, with torch's import of dynamo put off until `func` is first called."""
    return torch._disable_dynamo(func)


def enable(min_version: str | Callable | None = None) -> Callable:
    """`@enable` or `@enable("2.7.0")`: a decorator that, applied while compiling, keeps
    `func` compiled when torch is at least `min_version` and runs it eagerly otherwise;
    applied outside compilation (at import, as decorators are) it returns `func` as it is,
    as DeepSpeed's does."""

    def decorator(func: Callable) -> Callable:
        if not is_compiling():
            return func

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if min_version is None or required_torch_version(min_version=min_version):
                return func(*args, **kwargs)
            return disable(func)(*args, **kwargs)

        return wrapper

    if callable(min_version):
        func, min_version = min_version, None
        return decorator(func)
    return decorator


@contextlib.contextmanager
def compiled_autograd(enabled: bool, kwargs: dict) -> Iterator[None]:
    """Within the block, backward passes run through torch's compiled autograd, compiled
    with `torch.compile(backend="inductor", **kwargs)`; nothing when not `enabled` or when
    already compiling."""
    if not enabled or is_compiling():
        yield
        return
    from torch._dynamo.compiled_autograd import _enable

    with _enable(torch.compile(backend=COMPILE_BACKEND, **kwargs)):
        yield


def dummy_decorator(func: Callable) -> Callable:
    return func


def compile() -> Callable:
    """torch.compile, the decorator DeepSpeed hands out (`compile()(fn)`)."""
    return torch.compile
