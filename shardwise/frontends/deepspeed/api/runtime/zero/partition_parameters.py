"""`deepspeed.runtime.zero.partition_parameters` (also `deepspeed.zero`): `Init`,
`GatheredParameters`, the status names code written for ZeRO-3 imports, and the `ds_*`
attributes DeepSpeed puts on partitioned parameters.

`GatheredParameters` is shardwise's `gathered_parameters` (shardwise/runtime/zero/gathered.py)
with DeepSpeed's signature: full weights inside the block, edits made on
`modifier_rank` broadcast and kept on exit. As in DeepSpeed, tensors that no engine
partitions (a model not yet given to `initialize`, stages 0-2 without a
`modifier_rank`) need no gathering, and the block then does nothing.

`Init` is where DeepSpeed partitions each parameter as its module is constructed, so a
model larger than one device's memory can be built. shardwise partitions the model
when `initialize` receives it instead; inside `Init` the model is built as usual, whole
on every rank, with the same initial values. It does not lower the memory needed to
build the model: for that, build the model on the meta device and give `initialize` a
`param_init_fn` (shardwise.initialize; stage 3 then materialises each rank's partition).

DeepSpeed marks every parameter of a ZeRO-3 model with `ds_id` (a number unique in the
process), `ds_numel` and `ds_shape` (the whole parameter's size, which `.numel()` and
`.shape` no longer give once it is partitioned), `ds_persist` (kept whole, under the
persistence threshold) and `ds_status`, whether its full values are present right now.
Scripts test `hasattr(p, "ds_id")` to know they run under ZeRO-3, and gather only the
parameters whose status is NOT_AVAILABLE (DeepSpeed-Chat, Hugging Face's loaders).

shardwise keeps no per-parameter partition: it partitions units (one flat buffer per
module, shardwise/runtime/zero/layout.py). The engine built by `deepspeed.initialize`
marks its parameters once they are partitioned (`mark_partitioned`): the sizes come from
the unit that holds each parameter, and `ds_status` is read live from the parameter
itself (empty outside a gather), so it is never stale. `ds_tensor` (DeepSpeed's own
partition tensor) is not provided: this rank's share of a parameter is a range of its
unit's chunk, not a tensor of its own.
"""

from __future__ import annotations

import itertools
from contextlib import ExitStack
from enum import Enum
from types import TracebackType
from typing import Any, Callable, Iterable

import torch
from torch import nn

from shardwise.runtime.distributed.setup import init_distributed
from shardwise.runtime.zero.gathered import gathered_parameters, zero_of

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "ZeroParamType", "is_zero_param", "mark_partitioned",
           "register_external_parameter", "unregister_external_parameter"]


class ZeroParamType(Enum):
    NORMAL = 1  # whole on every rank
    PARTITIONED = 2
    REMOTE = 3


class ZeroParamStatus(Enum):
    AVAILABLE = 1  # full values present (gathered, or kept whole)
    NOT_AVAILABLE = 2  # partitioned and not gathered
    INFLIGHT = 3  # a gather in progress (shardwise's gathers complete before a parameter is read)


class PartitionedParameter(nn.Parameter):
    """A parameter of a ZeRO-3 engine: an `nn.Parameter` whose `ds_status` is computed
    from its current data. The class of each parameter is switched in place, so every
    reference the model and the script hold sees the attributes."""

    @property
    def ds_status(self) -> ZeroParamStatus:
        if self.data.numel() == 0 and self.ds_numel > 0:
            return ZeroParamStatus.NOT_AVAILABLE
        return ZeroParamStatus.AVAILABLE


_next_id = itertools.count()


def mark_partitioned(params: Iterable[tuple[nn.Parameter, torch.Size, bool]]) -> None:
    """Give each (parameter, full shape, kept whole) DeepSpeed's ZeRO-3 attributes."""
    for param, shape, persistent in params:
        if not isinstance(param, PartitionedParameter):
            param.__class__ = PartitionedParameter
            param.ds_id = next(_next_id)
        param.ds_shape = torch.Size(shape)
        param.ds_numel = param.ds_shape.numel()
        param.ds_persist = persistent


def unmark_partitioned(params: Iterable[nn.Parameter]) -> None:
    """Undo `mark_partitioned` (the engine is destroyed: the parameters are plain again)."""
    for param in params:
        if isinstance(param, PartitionedParameter):
            for name in ("ds_id", "ds_shape", "ds_numel", "ds_persist"):
                param.__dict__.pop(name, None)
            param.__class__ = nn.Parameter


def is_zero_param(parameter: Any) -> bool:
    """Whether `parameter` is held by a ZeRO-3 engine (DeepSpeed's test: it has a `ds_id`)."""
    return torch.is_tensor(parameter) and hasattr(parameter, "ds_id")


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """DeepSpeed's way to say that `module`'s forward reads a parameter of another module.
    shardwise gathers every unit a forward reads (its hooks follow use, not ownership), so
    there is nothing to register; the call checks its arguments and returns."""
    if not isinstance(module, nn.Module) or not torch.is_tensor(parameter):
        raise TypeError("register_external_parameter(module, parameter) takes an nn.Module and a parameter, got "
                        f"{type(module).__name__} and {type(parameter).__name__}")


def unregister_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    register_external_parameter(module, parameter)


# Hugging Face's `prevent_arange_dtype_change` (entered with `zero.Init` by `from_pretrained`)
# swaps this module's tensor-constructor wrapper for one that leaves `torch.arange` alone,
# and restores it after; both names must exist. shardwise's `Init` builds the model as
# torch does, so it wraps no constructor and the swap changes nothing.
_orig_torch_arange = torch.arange


def zero_wrapper_for_fp_tensor_constructor(fn: Callable, target_fp_dtype: torch.dtype | None,
                                           target_device: torch.device | None) -> Callable:
    """`fn` (a tensor constructor) creating on `target_device` when no device is given, and
    casting floating-point results to `target_fp_dtype`, as DeepSpeed's `Init` does."""

    def wrapped(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("device") is None and target_device is not None:
            kwargs["device"] = target_device
        tensor = fn(*args, **kwargs)
        if target_fp_dtype is not None and tensor.is_floating_point():
            tensor.data = tensor.data.to(target_fp_dtype)
        return tensor

    return wrapped


class Init:
    """A construction context that builds the model whole (see the module docstring).
    DeepSpeed's arguments (config, remote_device, pin_memory, dtype, ...) are accepted
    and change nothing: `initialize` applies the config to the finished model."""

    def __init__(self, module: nn.Module | None = None, *args: Any, enabled: bool = True, **kwargs: Any):
        """Joins the launcher's process group first, as DeepSpeed's does: code run inside
        (Hugging Face's loader) asks for ranks."""
        self.enabled = enabled
        if enabled:
            init_distributed()

    def __enter__(self) -> "Init":
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        return None


class GatheredParameters:
    def __init__(self, params: nn.Parameter | Iterable[nn.Parameter], modifier_rank: int | None = None,
                 fwd_module: nn.Module | None = None, enabled: bool = True):
        """`fwd_module` is DeepSpeed's hint for parameters a module uses outside its own
        forward; shardwise gathers whatever is used, so it is not needed."""
        if isinstance(params, torch.Tensor):
            params = [params]
        self.params = [param for param in (params or []) if _trained(param)] if enabled else []
        self.modifier_rank = modifier_rank
        self._stack = ExitStack()

    def __enter__(self) -> None:
        if self.params:
            self._stack.enter_context(gathered_parameters(self.params, self.modifier_rank))

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self._stack.close()


def _trained(param: torch.Tensor) -> bool:
    """Whether a live shardwise engine holds this parameter."""
    return zero_of(param) is not None
