"""`deepspeed.zero`: `Init` and `GatheredParameters` for code written against ZeRO-3.

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
"""

from __future__ import annotations

from contextlib import ExitStack
from types import TracebackType
from typing import Any, Iterable

import torch
from torch import nn

from shardwise.runtime.zero.gathered import gathered_parameters, zero_of

__all__ = ["GatheredParameters", "Init"]


class Init:
    """A construction context that builds the model whole (see the module docstring).
    DeepSpeed's arguments (config, remote_device, pin_memory, dtype, ...) are accepted
    and change nothing: `initialize` applies the config to the finished model."""

    def __init__(self, module: nn.Module | None = None, *args: Any, enabled: bool = True, **kwargs: Any):
        self.enabled = enabled

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
