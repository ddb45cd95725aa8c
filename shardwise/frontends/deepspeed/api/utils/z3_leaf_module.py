"""`deepspeed.utils`' ZeRO-3 leaf-module functions, which MoE scripts call before
`initialize` (Accelerate's `deepspeed_moe_layer_cls_names`, LLaMA-Factory's MoE patch):
a flagged module's parameters are gathered whole when it is entered
(runtime/zero/leaf_modules.py). DeepSpeed's flag (`_z3_leaf`) is set beside shardwise's
mark, so code that asks `z3_leaf_module(module)` gets DeepSpeed's answer."""

from __future__ import annotations

from torch import nn

from shardwise.runtime.zero.leaf_modules import mark_gathered_whole, qualified_class_name

_FLAG = "_z3_leaf"


def z3_leaf_module(model: nn.Module) -> bool:
    """Whether `model` is flagged a leaf."""
    return bool(getattr(model, _FLAG, False))


def z3_leaf_parameter(model: nn.Parameter) -> bool:
    """Whether a parameter belongs to a leaf module (DeepSpeed marks it once stage 3 hooks
    the model: `ds_z3_leaf_module`)."""
    return hasattr(model, "ds_z3_leaf_module")


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    return [module for module in model.modules() if z3_leaf_module(module)]


def set_z3_leaf_module(model: nn.Module, flag: bool) -> None:
    setattr(model, _FLAG, flag)
    mark_gathered_whole(model, flag)


def _matches(module: nn.Module, wanted: type | str) -> bool:
    if isinstance(wanted, type):
        return isinstance(module, wanted)
    return type(module).__name__ == wanted or qualified_class_name(module) == wanted


def _set_by_class(model: nn.Module, leaf_module_classes: list[type | str], flag: bool,
                  raise_if_not_found: bool) -> list[nn.Module]:
    if not all(isinstance(wanted, (type, str)) for wanted in leaf_module_classes):
        raise TypeError(f"leaf_module_classes must be a list of types or class names, got {leaf_module_classes}")
    found = [module for module in model.modules() if any(_matches(module, wanted) for wanted in leaf_module_classes)]
    for module in found:
        set_z3_leaf_module(module, flag)
    if not found and raise_if_not_found:
        raise ValueError(f"No modules of type {leaf_module_classes} found in model {type(model).__name__}")
    return found


def set_z3_leaf_modules(model: nn.Module, leaf_module_classes: list[type | str],
                        raise_if_not_found: bool = True) -> list[nn.Module]:
    """Flag every module of the given classes (types, or class names bare or qualified)."""
    return _set_by_class(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(model: nn.Module, leaf_module_classes: list[type | str],
                          raise_if_not_found: bool = True) -> list[nn.Module]:
    return _set_by_class(model, leaf_module_classes, False, raise_if_not_found)


def set_z3_leaf_modules_by_name(model: nn.Module, module_names: list[str], flag: bool = True,
                                raise_if_not_found: bool = True) -> tuple[list[nn.Module], list[str]]:
    """Flag the modules at these `named_modules()` paths: (flagged modules, missing names)."""
    modules = dict(model.named_modules())
    missing = [name for name in module_names if name not in modules]
    if missing and raise_if_not_found:
        raise ValueError(f"No modules named {missing} found in model {type(model).__name__}")
    found = [modules[name] for name in module_names if name in modules]
    for module in found:
        set_z3_leaf_module(module, flag)
    return found, missing


def set_z3_leaf_modules_by_suffix(model: nn.Module, module_name_suffixes: list[str], flag: bool = True,
                                  raise_if_not_found: bool = True) -> tuple[list[nn.Module], list[str]]:
    """Flag the modules whose path ends with one of the suffixes: (flagged, unmatched suffixes)."""
    modules = dict(model.named_modules())
    found: dict[int, nn.Module] = {}
    missing = []
    for suffix in module_name_suffixes:
        matched = [module for name, module in modules.items() if name.endswith(suffix)]
        found.update((id(module), module) for module in matched)
        if not matched:
            missing.append(suffix)
    if missing and raise_if_not_found:
        raise ValueError(f"No modules matching suffixes {missing} found in model {type(model).__name__}")
    for module in found.values():
        set_z3_leaf_module(module, flag)
    return list(found.values()), missing


__all__ = ["get_z3_leaf_modules", "set_z3_leaf_module", "set_z3_leaf_modules", "set_z3_leaf_modules_by_name",
           "set_z3_leaf_modules_by_suffix", "unset_z3_leaf_modules", "z3_leaf_module", "z3_leaf_parameter"]
