"""DeepSpeed's registry of external parameters: `module._external_params`, the ZeRO-3
parameters a module uses although another module owns them.

DeepSpeed needs the registry to gather such a parameter for the module's forward; shardwise
does not (its stage-3 hooks gather whatever a forward reads, whoever owns it), but code
written for DeepSpeed reads the registry, and `register_external_parameter` is public API.
So the registry is kept as DeepSpeed 0.19.8 keeps it (runtime/zero/parameter_offload.py):

- `register_external_parameter(module, parameter)` / `unregister_external_parameter` add
  and remove entries, keyed by `id(parameter)`;
- at stage 3 every module of the engine's model has a registry, and a parameter a module's
  forward *returns* (a dangling parameter: a layer handing its bias to its caller) is
  registered on the caller, unless a module still in the forward registers it already,
  and leaves the returning module's registry: it rises with each return to the module
  that uses it (`ReturnedParameterTracker`).
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["ReturnedParameterTracker", "register_external_parameter", "unregister_external_parameter"]


def _registry(module: nn.Module) -> dict[int, nn.Parameter]:
    """The module's registry, made (with DeepSpeed's `ds_external_parameters()`) on first use."""
    if not hasattr(module, "_external_params"):
        module._external_params = {}
        module.ds_external_parameters = types.MethodType(lambda self: self._external_params.items(), module)
    return module._external_params


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Note that `module`'s forward uses `parameter`, which another module owns. DeepSpeed
    needs this to gather it; shardwise gathers every parameter a forward reads anyway, and
    keeps the entry for code that reads `module._external_params`."""
    if not isinstance(parameter, nn.Parameter):
        raise RuntimeError(f"register_external_parameter takes a torch.nn.Parameter, got {type(parameter).__name__}")
    _registry(module)[id(parameter)] = parameter


def unregister_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Undo `register_external_parameter`; a parameter never registered on `module` is an error."""
    if not isinstance(parameter, nn.Parameter):
        raise RuntimeError(f"unregister_external_parameter takes a torch.nn.Parameter, got "
                           f"{type(parameter).__name__}")
    registry = getattr(module, "_external_params", {})
    if id(parameter) not in registry:
        raise RuntimeError(f"the parameter is not a registered external parameter of {type(module).__name__}")
    del registry[id(parameter)]


def _returned_tensors(output: Any) -> list[torch.Tensor]:
    """The tensors a forward returned, looked for as DeepSpeed looks: the output itself, the
    items of a list or tuple, the values of a dict or of an object's attributes."""
    if output is None:
        return []
    if torch.is_tensor(output):
        return [output]
    if isinstance(output, (list, tuple)):
        return [item for item in output if torch.is_tensor(item)]
    values = output if isinstance(output, dict) else vars(output) if hasattr(output, "__dict__") else {}
    return [value for name, value in values.items()
            if not (isinstance(name, str) and name.startswith("__")) and torch.is_tensor(value)]


class ReturnedParameterTracker:
    """Hooks on every module of a stage-3 model that keep the registries as DeepSpeed does
    (module docstring): the modules whose forward is running, outermost first, and after each
    forward the ZeRO-3 parameters it returned, registered on its caller."""

    def __init__(self, model: nn.Module):
        self._model = model
        self._running: list[nn.Module] = [model]  # as DeepSpeed's stack: the model at the bottom, always
        self._handles: list[RemovableHandle] = []
        for module in model.modules():
            _registry(module)
            self._handles.append(module.register_forward_pre_hook(self._enter))
            self._handles.append(module.register_forward_hook(self._leave))

    @torch.compiler.disable
    def _enter(self, module: nn.Module, inputs: Any) -> None:
        if module is self._model:  # a new forward: forget what a forward that raised left running
            del self._running[1:]
        self._running.append(module)

    @torch.compiler.disable
    def _leave(self, module: nn.Module, inputs: Any, output: Any) -> None:
        self._running.pop()
        for tensor in _returned_tensors(output):
            if not (isinstance(tensor, nn.Parameter) and hasattr(tensor, "ds_id")):
                continue
            if any(id(tensor) in _registry(running) for running in self._running):
                continue
            register_external_parameter(self._running[-1], tensor)
            if id(tensor) in _registry(module):  # it rose to the caller
                unregister_external_parameter(module, tensor)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
