"""`deepspeed.runtime.zero.partition_parameters` (also `deepspeed.zero`): `Init`,
`GatheredParameters`, the status names code written for ZeRO-3 imports, and the `ds_*`
attributes DeepSpeed puts on partitioned parameters.

`GatheredParameters` is shardwise's `gathered_parameters` (shardwise/runtime/zero/gathered.py)
with DeepSpeed's signature: full weights inside the block, edits made on
`modifier_rank` broadcast and kept on exit. As in DeepSpeed, tensors that no engine
partitions and that were not built inside `Init` (stages 0-2 without a `modifier_rank`,
a module added after `Init`) need no gathering, and the block then does nothing.

`Init` is where DeepSpeed partitions each parameter as its module is constructed, so a
model larger than one device's memory can be built. shardwise partitions the model
when `initialize` receives it instead; inside `Init` the model is built as usual, whole
on every rank, with the same initial values. It does not lower the memory needed to
build the model: for that, build the model on the meta device and give `initialize` a
`param_init_fn` (shardwise.initialize; stage 3 then materialises each rank's partition).

A parameter built inside `Init` is still one ZeRO-3 parameter to the code around it,
before any engine holds it: DeepSpeed gives every rank the values edited on
`modifier_rank` when a `GatheredParameters` block exits. Hugging Face's ZeRO-3 loader
relies on it (it reads the checkpoint on rank 0 only, inside such a block), and so does
what runs next on the other ranks: a vocabulary resize draws new rows from the loaded
embeddings' statistics, and whether it draws random numbers depends on them, so a rank
left with its own initial values would draw another random stream and train with
other dropout masks. `Init` therefore records the parameters its block registers
(`_BUILT_UNDER_INIT`, with the group DeepSpeed would partition them over), and
`GatheredParameters` broadcasts those from `modifier_rank` on exit.

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
import threading
import weakref
from contextlib import ExitStack
from enum import Enum
from types import TracebackType
from typing import Any, Callable, Iterable

import torch
from torch import nn

import torch.distributed as dist

from shardwise.frontends.deepspeed.api.runtime.zero.external_parameters import (register_external_parameter,
                                                                               unregister_external_parameter)
from shardwise.runtime.distributed.setup import init_distributed
from shardwise.runtime.distributed.staging import group_device, staged_on
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
        param.ds_active_sub_modules = set()  # DeepSpeed's; RLHF code clears it (parameter_offload.py)


def unmark_partitioned(params: Iterable[nn.Parameter]) -> None:
    """Undo `mark_partitioned` (the engine is destroyed: the parameters are plain again)."""
    for param in params:
        if isinstance(param, PartitionedParameter):
            for name in ("ds_id", "ds_shape", "ds_numel", "ds_persist", "ds_active_sub_modules"):
                param.__dict__.pop(name, None)
            param.__class__ = nn.Parameter


def is_zero_param(parameter: Any) -> bool:
    """Whether `parameter` is held by a ZeRO-3 engine (DeepSpeed's test: it has a `ds_id`)."""
    return torch.is_tensor(parameter) and hasattr(parameter, "ds_id")


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


# Parameters registered inside an `Init` block, by identity: (a weak reference to the
# parameter, the process group DeepSpeed would partition it over, None: the world). An entry
# leaves with its parameter, so a dropped model leaves nothing behind.
_BUILT_UNDER_INIT: dict[int, tuple[weakref.ref, dist.ProcessGroup | None]] = {}


def _record_built(param: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    key = id(param)

    def forget(reference: weakref.ref) -> None:
        if _BUILT_UNDER_INIT.get(key, (None,))[0] is reference:
            del _BUILT_UNDER_INIT[key]

    _BUILT_UNDER_INIT[key] = (weakref.ref(param, forget), group)


def built_under_init(param: torch.Tensor) -> bool:
    """Whether `param` was registered by a module built inside `Init`."""
    entry = _BUILT_UNDER_INIT.get(id(param))
    return entry is not None and entry[0]() is param


class Init:
    """A construction context that builds the model whole and records its parameters (see
    the module docstring). DeepSpeed's other arguments (config, remote_device, pin_memory,
    dtype, ...) are accepted and change nothing: `initialize` applies the config to the
    finished model."""

    def __init__(self, module: nn.Module | None = None, *args: Any, enabled: bool = True,
                 data_parallel_group: dist.ProcessGroup | None = None, **kwargs: Any):
        """Joins the launcher's process group first, as DeepSpeed's does: code run inside
        (Hugging Face's loader) asks for ranks. `module`: a model built already, whose
        parameters count as built inside (DeepSpeed partitions them on the spot)."""
        self.enabled = enabled
        self.group = data_parallel_group
        self._hook: Any = None
        if enabled:
            init_distributed()
            for param in module.parameters() if module is not None else ():
                _record_built(param, self.group)

    def __enter__(self) -> "Init":
        if self.enabled:
            thread = threading.get_ident()  # run_distributed's ranks are threads of one process

            def record(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
                if param is not None and threading.get_ident() == thread:
                    _record_built(param, self.group)

            self._hook = nn.modules.module.register_module_parameter_registration_hook(record)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


class GatheredParameters:
    def __init__(self, params: nn.Parameter | Iterable[nn.Parameter], modifier_rank: int | None = None,
                 fwd_module: nn.Module | None = None, enabled: bool = True):
        """`fwd_module` is DeepSpeed's hint for parameters a module uses outside its own
        forward; shardwise gathers whatever is used, so it is not needed."""
        if isinstance(params, torch.Tensor):
            params = [params]
        params = list(params or []) if enabled else []
        self.params = [param for param in params if _trained(param)]
        # built inside `Init`, not yet given to an engine: whole on every rank, so only the
        # edits need to travel (the module docstring says why they must)
        self.built = [param for param in params if not _trained(param) and built_under_init(param)]
        self.modifier_rank = modifier_rank
        self._stack = ExitStack()

    def __enter__(self) -> None:
        if self.params:
            self._stack.enter_context(gathered_parameters(self.params, self.modifier_rank))

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self._stack.close()
        if self.modifier_rank is not None and kind is None:
            _broadcast_edits(self.built, self.modifier_rank)


def _broadcast_edits(params: list[nn.Parameter], modifier_rank: int) -> None:
    """Every rank takes `modifier_rank`'s values of `params` (built inside `Init`), in the
    order given, which is the same on every rank: the block is a collective, as in DeepSpeed."""
    if not params or not dist.is_initialized():
        return
    for param in params:
        group = _BUILT_UNDER_INIT[id(param)][1]
        with torch.no_grad(), staged_on(param.data, group_device(group or dist.group.WORLD)) as staged:
            dist.broadcast(staged, src=modifier_rank, group=group)


def _trained(param: torch.Tensor) -> bool:
    """Whether a live shardwise engine holds this parameter."""
    return zero_of(param) is not None
