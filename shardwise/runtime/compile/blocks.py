"""`torch.compile` per block: the "compile" step of a model's `parallelize`.

The step comes after tensor/sequence parallelism, checkpointing and the model family's
kernel rewrites (fused operators, block-sparse attention: shardwise/models/), so it sees
the final modules, and before ZeRO, so the rewrites keep their Parameter objects for ZeRO
to partition.

Compilation is per block (each repeated transformer layer), as torchtitan does: one graph
per layer type, compiled once and reused by every layer, instead of one graph for the
whole model that any data-dependent step of the loss or embedding would break.

ZeRO-3 gathers a module's parameters in hooks on that module, and those hooks (collectives,
Python bookkeeping) cannot be traced into a graph. Hooks of modules inside a compiled block
are therefore hoisted to the block's boundary: the compiled code runs with the inner
modules' hook tables empty, their pre-forward hooks run just before the block (all of the
block's parameters are gathered, which its single compiled graph needs anyway) and their
forward hooks just after, given the block's output (so ZeRO-3 regathers them when the
block's gradient arrives, before the compiled backward runs). A hook that returns a
replacement input or output cannot be hoisted and is an error, unless it is marked
`traceable_hook`: then it stays on its module and is traced with the block. Stages 0-2 register no
module hooks, and their gradient hooks fire on the parameters, outside compiled code.

Activation checkpointing (the slot before this one) runs a block as a region through
torch's checkpoint; the region stays eager and the block's own forward is compiled inside
it (compile_blocks), so the compiled graph runs in forward and again in the
recomputation, with the hoisted gathers before each. The selective policy decides per
operator the compiled graph dispatches: with Inductor these are only the generated code's
`mm.out` and attention calls (its fused loops dispatch nothing), which the default rule
does not keep, so a compiled selective region recomputes like a full one. Tensor parallelism's
collectives run inside the graph as opaque custom operators (shardwise.runtime.ops.region_collectives).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable

import torch
from torch import nn

from shardwise.runtime.compile.policy import CompilePolicy

HOOK_TABLES = ("_forward_pre_hooks", "_forward_hooks")


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated layers: the classes a Hugging Face model lists as `_no_split_modules`,
    else the items of every `nn.ModuleList` whose items share one class (GPT's blocks)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    if names:
        return [m for m in model.modules() if type(m).__name__ in names]
    blocks = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) and len({type(m) for m in module}) == 1:
            blocks.extend(module)
    return blocks


TRACEABLE = "_shardwise_traceable"


def traceable_hook(hook: Callable) -> Callable:
    """Mark a module hook as one Dynamo can trace (tensor operations, opaque custom
    operators): inside a compiled block it stays on its module and runs in the graph,
    so it may return a replacement value (tensor parallelism's region entry does)."""
    setattr(hook, TRACEABLE, True)
    return hook


def _hoisted(hooks: OrderedDict) -> list[tuple[int, Callable]]:
    return [(hook_id, hook) for hook_id, hook in hooks.items() if not getattr(hook, TRACEABLE, False)]


def _hooked_descendants(block: nn.Module) -> list[nn.Module]:
    return [m for m in block.modules() if m is not block and any(_hoisted(getattr(m, t)) for t in HOOK_TABLES)]


def _call_hook(module: nn.Module, hook_id: int, hook: Callable, args: tuple, kwargs: dict, *output: Any) -> None:
    if hook_id in (module._forward_pre_hooks_with_kwargs if not output else module._forward_hooks_with_kwargs):
        result = hook(module, args, kwargs, *output)
    else:
        result = hook(module, args, *output)
    if result is not None:
        raise RuntimeError(
            f"a forward hook on {type(module).__name__} inside a compiled block returns a replacement "
            "value, which cannot run outside the compiled graph: set compile.enabled false, or register "
            "the hook on the block itself"
        )


class HoistedHooks:
    """Runs a compiled block with its inner modules' hooks moved to the block's boundary."""

    def __init__(self, block: nn.Module, compiled: Callable[..., Any]):
        self.block = block
        self.compiled = compiled
        # per module, the traceable hooks left in place: one pair of tables, refilled, for stable guards
        self.kept: dict[int, tuple[OrderedDict, OrderedDict]] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        hooked = _hooked_descendants(self.block)
        if not hooked:
            return self.compiled(*args, **kwargs)
        for module in hooked:
            for hook_id, hook in _hoisted(module._forward_pre_hooks):
                _call_hook(module, hook_id, hook, args, kwargs)
        saved = [(module, module._forward_pre_hooks, module._forward_hooks) for module in hooked]
        try:
            for module in hooked:
                tables = self.kept.setdefault(id(module), (OrderedDict(), OrderedDict()))
                for kept, hooks in zip(tables, (module._forward_pre_hooks, module._forward_hooks)):
                    hoisted = dict(_hoisted(hooks))
                    kept.clear()
                    kept.update((hook_id, hook) for hook_id, hook in hooks.items() if hook_id not in hoisted)
                module._forward_pre_hooks, module._forward_hooks = tables
            output = self.compiled(*args, **kwargs)
        finally:
            for module, pre_hooks, hooks in saved:
                module._forward_pre_hooks, module._forward_hooks = pre_hooks, hooks
        for module in reversed(hooked):
            for hook_id, hook in _hoisted(module._forward_hooks):
                _call_hook(module, hook_id, hook, args, kwargs, output)
        return output


def _checkpoint_regions(blocks: list[nn.Module]) -> dict[int, tuple[Any, int]]:
    """id(block) -> (its checkpointed region, its position there), for blocks that
    activation checkpointing runs as regions (shardwise/runtime/activation/apply.py): a region's
    first layer has the region's bound `leader` as its forward and lists its members."""
    from shardwise.runtime.activation.apply import _Region

    regions = {}
    for block in blocks:
        region = getattr(block.forward, "__self__", None)
        if isinstance(region, _Region):
            regions.update({id(member): (region, position) for position, member in enumerate(region.members)})
    return regions


def compile_blocks(model: nn.Module, policy: CompilePolicy = CompilePolicy(enabled=True),
                   blocks: list[nn.Module] | None = None) -> nn.Module:
    """Compile each block's forward in place (parameter names and the module tree unchanged).

    A checkpointed block keeps its region wrapper eager and gets its own forward compiled
    inside it: the wrapper's bookkeeping (torch's checkpoint, saved-tensor hooks, RNG
    replay, timers) cannot be traced, so compiling it would break the graph at every step
    and compile nothing. The compiled forward then runs twice, in forward and in the
    recomputation, with ZeRO-3's hoisted gathers before each run. `blocks`: the model
    family's repeated layers (default: found, `find_blocks`)."""
    blocks = find_blocks(model) if blocks is None else blocks
    if not blocks:
        raise ValueError(f"compile.enabled: found no repeated blocks in {type(model).__name__} to compile (looked for "
                         "`_no_split_modules` classes and nn.ModuleList items of one class)")
    regions = _checkpoint_regions(blocks)
    for block in blocks:
        region, position = regions.get(id(block), (None, 0))
        forward = region.originals[position] if region is not None else block.forward
        kwargs = dict(policy.kwargs)
        mode = kwargs.pop("mode", policy.mode)
        hoisted = HoistedHooks(block, torch.compile(forward, backend=policy.backend, mode=mode, **kwargs))
        if region is not None:
            region.originals[position] = hoisted
        else:
            block.forward = hoisted
    return model
