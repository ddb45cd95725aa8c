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
"""

from __future__ import annotations

import logging
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
    unmatched = [name for name in policy.names if name not in paths]
    unmatched += [suffix for suffix in policy.name_suffixes if not any(path.endswith(suffix) for path in paths)]
    if unmatched:
        log.warning("leaf modules: no module of the model is named or ends with %s; the modules below keep their "
                    "own stage-3 hooks", ", ".join(repr(name) for name in unmatched))
    return chosen
