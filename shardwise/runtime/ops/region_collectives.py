"""Tensor-parallel region collectives as opaque custom operators, for compiled blocks.

Tensor parallelism's collectives (shardwise/runtime/parallel/tensor/regions.py) are autograd
functions that call shardwise's counted `Communicator`: Python bookkeeping (byte counts,
timers, error messages) around asynchronous torch.distributed calls. Dynamo cannot trace
that, so a compiled tensor-parallel block broke into a graph per collective. Inside a
compiled region each of those functions runs instead as the custom operator
`shardwise::tensor_region`, which Dynamo, AOTAutograd and Inductor keep as one opaque call:
at run time it calls the same function's forward (and `tensor_region_backward` its
backward), so results and counted bytes are those of eager.

The operator takes the function by its registered class name and the communicator by a
registry key, its `id` (an operator's arguments are tensors and plain values; Dynamo
evaluates `id(comm)` while tracing and guards on that object). A communicator is
registered outside tracing (`register_communicator`, which `TensorRegion` calls), because
a traced function cannot change Python state before the graph runs. Shapes for tracing come from running
the function's own forward on fake tensors with a communicator that only has a size and a
rank: its collectives move nothing, the output buffers they fill are allocated by the
function itself.
"""

from __future__ import annotations

import weakref
from types import SimpleNamespace
from typing import Any

import torch

_FUNCTIONS: dict[str, type[torch.autograd.Function]] = {}
_COMMUNICATORS: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()


class _Done:
    def wait(self) -> None:
        return None


class _ShapeOnly:
    """A communicator for tracing: the group's size and rank, collectives that do nothing."""

    def __init__(self, size: int, rank: int):
        self.size, self.rank = size, rank

    def all_reduce(self, *args: Any) -> _Done:
        return _Done()

    all_gather = reduce_scatter = all_reduce


def register_region_functions(*functions: type[torch.autograd.Function]) -> None:
    """Make `functions` (by class name) callable through the operator."""
    for function in functions:
        if _FUNCTIONS.setdefault(function.__name__, function) is not function:
            raise ValueError(f"two region functions are named {function.__name__}")


def register_communicator(comm: Any) -> None:
    """Make `comm` reachable from the operator by its `id` (held weakly: a registered
    communicator lives as long as its owner)."""
    _COMMUNICATORS[id(comm)] = comm


def _communicator(key: int) -> Any:
    comm = _COMMUNICATORS.get(key)
    if comm is None:
        raise RuntimeError("a tensor-parallel region collective ran inside a compiled block with a communicator "
                           "that was never registered: pass it to shardwise.runtime.ops.region_collectives."
                           "register_communicator (TensorRegion does) before compiling")
    return comm


def _function(name: str) -> type[torch.autograd.Function]:
    return _FUNCTIONS[name]


def _unaliased(output: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A custom operator's output may not alias its input (identity forwards return a view)."""
    return output.clone() if torch._C._is_alias_of(output, x) else output


def _shape_only(key: int) -> _ShapeOnly:
    comm = _communicator(key)
    return _ShapeOnly(comm.size, comm.rank)


@torch.library.custom_op("shardwise::tensor_region", mutates_args=())
def _tensor_region(x: torch.Tensor, function: str, comm: int) -> torch.Tensor:
    return _unaliased(_function(function).forward(SimpleNamespace(), x, _communicator(comm)), x)


@_tensor_region.register_fake
def _(x: torch.Tensor, function: str, comm: int) -> torch.Tensor:
    return _unaliased(_function(function).forward(SimpleNamespace(), x, _shape_only(comm)), x)


@torch.library.custom_op("shardwise::tensor_region_backward", mutates_args=())
def _tensor_region_backward(grad: torch.Tensor, function: str, comm: int) -> torch.Tensor:
    ctx = SimpleNamespace(comm=_communicator(comm))
    return _unaliased(_function(function).backward(ctx, grad)[0], grad)


@_tensor_region_backward.register_fake
def _(grad: torch.Tensor, function: str, comm: int) -> torch.Tensor:
    return _unaliased(_function(function).backward(SimpleNamespace(comm=_shape_only(comm)), grad)[0], grad)


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
    return torch.ops.shardwise.tensor_region_backward(grad, ctx.function, ctx.comm), None, None


def _setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    _, ctx.function, ctx.comm = inputs


_tensor_region.register_autograd(_backward, setup_context=_setup_context)


def apply_region(function: str, x: torch.Tensor, comm: Any) -> torch.Tensor:
    """`apply(x, comm)` of the registered region function named `function`
    (register_region_functions), as one opaque operator when Dynamo is tracing (by name:
    Dynamo passes strings to operators, not classes).

    The function's forward may only set `ctx.comm` and its backward only read it (true of
    every region collective)."""
    if not torch.compiler.is_compiling():
        return _FUNCTIONS[function].apply(x, comm)
    return torch.ops.shardwise.tensor_region(x, function, id(comm))
