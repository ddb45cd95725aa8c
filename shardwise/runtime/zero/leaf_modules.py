"""Modules whose stage-3 parameters are gathered whole when they are entered ("leaf modules").

Stage 3 gathers each module's own parameters when that module's forward starts, and the
ranks must gather the same units in the same order (gather_schedule.py). A mixture of
experts breaks that when each expert is a module of its own: a rank runs only the experts
its tokens were routed to, so one rank gathers expert 3 while another gathers expert 5, and
the trace changes from step to step. Marking the MoE block a leaf puts every parameter
below it in one unit, gathered when the block is entered and released after it, whatever
experts run inside; nothing below it gets a hook. The same helps a module made of many
tiny ones, whose per-module hooks cost more than their gathers.

Modules are marked by `mark_gathered_whole` (DeepSpeed's `set_z3_leaf_modules` calls it)
or chosen by a `LeafModulePolicy` (DeepSpeed's `zero_optimization.leaf_module` block): by
class (its name or module-qualified name), by exact module path, or by path suffix. A leaf
inside another leaf is covered by the outer one.

The policy's `granularity_threshold` (DeepSpeed's `stage3_module_granularity_threshold`)
chooses leaves by size instead, with DeepSpeed 0.19.8's rule: a module's granularity is
its parameters (tied ones counted in every child that holds them) divided by the modules
with parameters it is made of, itself included (containers such as `ModuleList` are not
counted, and never become leaves: their forward is not called); a module with no children
or over 10^9 parameters has none. Going down from the root, the first module whose
granularity is at most the threshold becomes a leaf. Per-unit work (hooks, a collective
and its hand-over per unit and pass) is paid per leaf instead of per module; the cost is
that a leaf is gathered whole, so more parameters are live at once.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

from torch import nn

_MARK = "_shardwise_gathered_whole"
log = logging.getLogger("shardwise")


@dataclass(frozen=True)
class LeafModulePolicy:
    """Which modules are gathered whole at stage 3, besides those marked on the model."""

    classes: tuple[str, ...] = ()  # class names, bare ("MixtralSparseMoeBlock") or with their module
    names: tuple[str, ...] = ()  # module paths, as `named_modules()` gives them
    name_suffixes: tuple[str, ...] = ()  # ends of module paths
    granularity_threshold: int = 0  # > 0: also modules whose granularity is at most this (see above)


def mark_gathered_whole(module: nn.Module, whole: bool = True) -> None:
    """Gather every parameter below `module` as one unit (or, False, undo it)."""
    setattr(module, _MARK, whole)


def is_marked_gathered_whole(module: nn.Module) -> bool:
    return bool(getattr(module, _MARK, False))


def qualified_class_name(module: nn.Module) -> str:
    return f"{type(module).__module__}.{type(module).__qualname__}"


def leaf_modules(model: nn.Module, policy: LeafModulePolicy) -> set[nn.Module]:
    """The modules of `model` gathered whole: marked ones and those the policy names. A
    path or suffix that names no module is logged (a typo would silently leave the hooks
    inside); classes are not, since the defaults name MoE blocks most models lack."""
    chosen = set()
    paths = dict(model.named_modules())
    for path, module in paths.items():
        if (is_marked_gathered_whole(module)
                or type(module).__name__ in policy.classes or qualified_class_name(module) in policy.classes
                or path in policy.names or any(path.endswith(suffix) for suffix in policy.name_suffixes)):
            chosen.add(module)
    if policy.granularity_threshold > 0:
        chosen |= modules_under_granularity(model, policy.granularity_threshold)
    unmatched = [name for name in policy.names if name not in paths]
    unmatched += [suffix for suffix in policy.name_suffixes if not any(path.endswith(suffix) for path in paths)]
    if unmatched:
        log.warning("leaf modules: no module of the model is named or ends with %s; the modules below keep their "
                    "own stage-3 hooks", ", ".join(repr(name) for name in unmatched))
    return chosen


MAX_LEAF_PARAMETERS = 10**9  # DeepSpeed's Z3_MAX_LEAF_SIZE: a larger leaf would hold too much live
NO_GRANULARITY = sys.maxsize


def modules_under_granularity(model: nn.Module, threshold: int) -> set[nn.Module]:
    """The leaves DeepSpeed's `stage3_module_granularity_threshold` chooses (module docstring);
    none, with a warning naming the smallest granularity, when no module is that fine."""
    granularity: dict[nn.Module, int] = {}

    def measure(module: nn.Module) -> tuple[int, int]:
        """(modules with parameters counted as layers, parameters) of `module`'s subtree."""
        if next(module.parameters(), None) is None:
            granularity[module] = NO_GRANULARITY
            return 0, 0
        params = sum(p.numel() for p in module.parameters(recurse=False))
        children = list(module.children())
        if not children:
            granularity[module] = NO_GRANULARITY
            return 1, params
        layers = 0
        for child in children:
            child_layers, child_params = measure(child)
            layers, params = layers + child_layers, params + child_params
        if type(module).__name__ in _CONTAINERS:
            granularity[module] = NO_GRANULARITY
            return layers, params
        layers += 1
        granularity[module] = params // layers if params <= MAX_LEAF_PARAMETERS else NO_GRANULARITY
        return layers, params

    measure(model)
    finest = min(granularity.values())
    if finest > threshold:
        reason = ("no module has a granularity (each is a container or has no children)" if finest == NO_GRANULARITY
                  else f"the finest has {finest} parameters per module; raise the threshold to at least {finest} "
                       "to gather some whole")
        log.warning("stage3_module_granularity_threshold %d: no module is that fine, so every module keeps its own "
                    "stage-3 hooks (%s)", threshold, reason)
        return set()
    chosen: set[nn.Module] = set()

    def choose(module: nn.Module) -> None:
        if next(module.parameters(), None) is None:
            return
        if granularity[module] <= threshold:
            chosen.add(module)
            return
        for child in module.children():
            choose(child)

    choose(model)
    return chosen


_CONTAINERS = frozenset(("Container", "Sequential", "ModuleList", "ModuleDict", "ParameterList", "ParameterDict"))
