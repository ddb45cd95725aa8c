"""Any `torch.optim` optimizer and `torch.optim.lr_scheduler` schedule by its class name, as
DeepSpeed 0.19.8 builds a config's `optimizer.type` or `scheduler.type` that is not one of
its own (runtime/engine.py: `_configure_basic_optimizer` calls
`getattr(torch.optim, name)(model_parameters, **params)`, `_scheduler_from_config` calls
`getattr(torch.optim.lr_scheduler, name)(optimizer, **params)`): the class's exact name
(DeepSpeed matches only its own names in any letter case), and `params` passed as given.

shardwise steps such an optimizer as it steps torch's Adam: over the rank's fp32 segments
under ZeRO, its state saved and resharded element by element (optim/codec.py). Whether a
class can train that way, and how many fp32 tensors of state it keeps (K,
docs/formulas.md#optimizer-state-bytes-k), is found by building it over a three-element
parameter and taking one step with the config's params. A class that needs a closure
(LBFGS) or sparse gradients (SparseAdam), or keeps state that is not element-wise, is
refused with the reason: DeepSpeed builds it, then fails at the first step. A schedule is
checked the same way, built over a one-parameter SGD with momentum and stepped once: one
that needs a metric to step (ReduceLROnPlateau) or other schedules or callables (LambdaLR,
SequentialLR) cannot come from a JSON config, and DeepSpeed fails on it too.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import warnings
from typing import Any

import torch

from shardwise.runtime.optim.registry import OptimizerSpec

PROBE_NUMEL = 3  # not 1, so that element-wise state is told apart from a scalar


def torch_optimizer_class(name: str) -> type[torch.optim.Optimizer] | None:
    """`torch.optim.<name>` when it is an optimizer class (not the base class)."""
    cls = getattr(torch.optim, name, None)
    if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) and cls is not torch.optim.Optimizer:
        return cls
    return None


def torch_scheduler_class(name: str) -> type | None:
    """`torch.optim.lr_scheduler.<name>` when it is a schedule class (not a base class)."""
    cls = getattr(torch.optim.lr_scheduler, name, None)
    bases = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
    if isinstance(cls, type) and issubclass(cls, bases) and cls is not torch.optim.lr_scheduler.LRScheduler \
            and not name.startswith("_"):
        return cls
    return None


def constructor_arguments(cls: type) -> list[inspect.Parameter]:
    """The keyword arguments of `cls(first, ...)`: everything after `self` and the parameters
    or optimizer it is built over."""
    arguments = list(inspect.signature(cls.__init__).parameters.values())[2:]
    return [argument for argument in arguments
            if argument.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]


def _declaration(cls: type) -> type:
    """A params dataclass (optim/params.py's form) of the constructor's keyword arguments
    and defaults; their values are checked by building the optimizer (`_probe`)."""
    fields = [(argument.name, Any) if argument.default is inspect.Parameter.empty
              else (argument.name, Any, dataclasses.field(default=argument.default))
              for argument in constructor_arguments(cls)]
    declaration = dataclasses.make_dataclass(f"{cls.__name__}Params", fields, frozen=True, kw_only=True)
    declaration.__doc__ = f"`torch.optim.{cls.__name__}`'s arguments and defaults, passed as given."
    return declaration


def _probe(cls: type[torch.optim.Optimizer], params: dict[str, Any]) -> int:
    """Build `cls` over a small parameter and step it once as the engine does (no closure,
    a dense gradient); the number of element-wise state tensors it then keeps."""
    weight = torch.zeros(PROBE_NUMEL, requires_grad=True)
    weight.grad = torch.ones(PROBE_NUMEL)
    optimizer = cls([weight], **params)
    optimizer.step()
    tensors = [value for value in optimizer.state[weight].values() if torch.is_tensor(value)]
    if any(tensor.dim() != 0 and tuple(tensor.shape) != (PROBE_NUMEL,) for tensor in tensors):
        raise ValueError("it keeps optimizer state that is not one value per element, which ZeRO cannot split")
    return sum(tensor.dim() == 1 for tensor in tensors)


def _check(cls: type[torch.optim.Optimizer], params: dict[str, Any]) -> None:
    try:
        _probe(cls, params)
    except Exception as error:  # torch's own message says what is wrong with the class or a value
        raise ValueError(f": torch.optim.{cls.__name__} cannot be built and stepped as DeepSpeed steps a config's "
                         "optimizer (once per update, without a closure, on dense gradients) with these params "
                         f"({type(error).__name__}: {error}); DeepSpeed 0.19.8 fails on them too") from None


@functools.cache
def torch_optimizer_spec(name: str) -> OptimizerSpec | None:
    """The spec for `torch.optim.<name>`, or None where torch has no such optimizer."""
    cls = torch_optimizer_class(name)
    if cls is None:
        return None

    def build(groups: list[dict[str, Any]], params: dict[str, Any]) -> torch.optim.Optimizer:
        return cls(groups, **params)

    return OptimizerSpec(name, _declaration(cls), build, fp32_states=lambda params: _probe(cls, params),
                         check_params=lambda params: _check(cls, params))


def check_torch_scheduler(name: str, params: dict[str, Any]) -> None:
    """Raise ValueError (its message starting with ": ") where `torch.optim.lr_scheduler.<name>`
    cannot be built from `params` and stepped as the engine steps a schedule."""
    cls = torch_scheduler_class(name)
    assert cls is not None, name
    weight = torch.zeros(1, requires_grad=True)
    try:
        with warnings.catch_warnings():  # torch's warning that the probe steps no optimizer first
            warnings.simplefilter("ignore")
            cls(torch.optim.SGD([weight], lr=0.1, momentum=0.9), **params).step()
    except Exception as error:  # torch's own message says what is wrong
        raise ValueError(f": torch.optim.lr_scheduler.{name} cannot be built from these params and stepped once per "
                         f"update as DeepSpeed steps a config's schedule ({type(error).__name__}: {error}); "
                         "DeepSpeed 0.19.8 fails on them too") from None
