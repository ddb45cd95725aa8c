"""`deepspeed.runtime.zero.parameter_offload.DeepSpeedZeRoOffload`: the object DeepSpeed's
ZeRO-3 optimizer keeps as `optimizer.parameter_offload`, which holds the stage-3 module
hooks. RLHF code reaches into it to generate from gathered weights without them: TRL's
`unwrap_model_for_generation` (its `remove_hooks` / `add_hooks`) gathers every parameter,
removes the hooks (`forward_hooks`, `backward_hooks`, each handle's `remove()`), clears
each parameter's `ds_active_sub_modules`, generates, then invalidates the coordinator's
trace and re-registers them (`_register_deepspeed_module(module)`).

shardwise's stage-3 hooks are not per-module handles: its gather schedule
(runtime/zero/gather_schedule.py) decides at each module whether to gather. Removing the
hooks here makes that schedule stand aside (`standing_aside`, as `gathered_for_generation`
does for shardwise's own generation path): forwards without gradients read the gathered
units and communicate nothing, any number of them per rank. Re-registering ends it.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any, Callable

from torch import nn

__all__ = ["DeepSpeedZeRoOffload"]


class _HookHandle:
    """A removable hook as DeepSpeed lists them; removing it sets the schedule aside."""

    def __init__(self, on_remove: Callable[[], None]):
        self._on_remove = on_remove

    def remove(self) -> None:
        self._on_remove()


class _ParamCoordinator:
    """DeepSpeed's `PartitionedParameterCoordinator` as TRL asks it: whether its recorded
    trace is invalid, and to invalidate it. shardwise's schedule checks its own trace at
    every use (a forward that leaves it starts a new one), so these only record the ask."""

    def __init__(self) -> None:
        self._invalid = False

    def is_invalid_trace(self) -> bool:
        return self._invalid

    def _invalidate_trace(self) -> None:
        self._invalid = True


class DeepSpeedZeRoOffload:
    def __init__(self, module: nn.Module, schedule: Any):
        """`module`: the engine's model (at stage 3 each of its modules has DeepSpeed's
        `ds_external_parameters()`, which TRL reads: external_parameters.py); `schedule`:
        its stage-3 gather schedule."""
        self.module = module
        self._schedule = schedule
        self._aside: ExitStack | None = None
        self.param_coordinator = _ParamCoordinator()
        self.forward_hooks: list[_HookHandle] = [_HookHandle(self._stand_aside)]
        self.backward_hooks: list[_HookHandle] = []

    def _stand_aside(self) -> None:
        if self._aside is None:
            self._aside = ExitStack()
            self._aside.enter_context(self._schedule.standing_aside())

    def _register_deepspeed_module(self, module: nn.Module) -> None:
        """The hooks back: the schedule gathers and releases again."""
        if module is not self.module:
            raise ValueError("_register_deepspeed_module(module): shardwise's engine registers the hooks of the "
                             "model it was built with only")
        if self._aside is not None:
            self._aside.close()
            self._aside = None
        self.forward_hooks = [_HookHandle(self._stand_aside)]
        self.param_coordinator = _ParamCoordinator()
