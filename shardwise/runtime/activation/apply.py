"""`apply_activation_checkpointing`: a recomputation policy applied to a model from outside.

The model is not edited: each checkpointed region's first layer gets an instance-level
`forward` that runs the region through `run_checkpointed`; its module hooks (ZeRO-3's
gathers, tensor-parallel hooks) stay outside the checkpoint and run once, while the hooks
of the submodules inside run again in the recomputation, which is what makes ZeRO-3
gather the parameters the recomputation needs. Hugging Face decoder layers are plain
modules here; their own `gradient_checkpointing` must stay off (it would checkpoint twice).

A region of several layers (the √n policy) is run whole by its first layer, which calls
the others through their modules (their hooks run inside the region); when the model's
own loop then calls those layers, they hand their input straight back (for tuple outputs,
with the rest of the region's last output), since the region already computed it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Callable

import torch
from torch import nn

from shardwise.runtime.activation.checkpoint import RegionStats, run_checkpointed
from shardwise.runtime.activation.layers import resolve_layers
from shardwise.runtime.activation.policy import RecomputePolicy
from shardwise.runtime.activation.selective import SaveRule, save_rule
from shardwise.runtime.activation.store import CheckpointStore

log = logging.getLogger("shardwise")
MARK = "_shardwise_recompute_policy"
STATS = "_shardwise_recompute_stats"
_cache_warned = False


class _Region:
    def __init__(self, members: list[nn.Module], run: Callable[[Callable, tuple, dict], Any]):
        self.members = members
        self.originals = [member.forward for member in members]
        self.run = run
        self.running = False  # the first layer is calling the others
        self.pass_through = 0  # calls still to hand back after the region ran
        self.rest: tuple | None = None  # the region's output beyond hidden states, for tuple outputs

    def leader(self, *args: Any, **kwargs: Any) -> Any:
        if not (torch.is_grad_enabled() and self.members[0].training):
            self.pass_through = 0
            return self.originals[0](*args, **kwargs)
        output = self.run(self.chain, *_without_cache(args, kwargs))
        self.pass_through = len(self.members) - 1
        self.rest = tuple(output[1:]) if isinstance(output, tuple) else None
        return output

    def chain(self, *args: Any, **kwargs: Any) -> Any:
        output = self.originals[0](*args, **kwargs)
        self.running = True
        try:
            for member in self.members[1:]:
                hidden = output[0] if isinstance(output, tuple) else output
                next_args, next_kwargs = _with_hidden(args, kwargs, hidden)
                output = member(*next_args, **next_kwargs)
        finally:
            self.running = False
        return output

    def follower(self, index: int) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            if self.running or self.pass_through == 0:
                return self.originals[index](*args, **kwargs)  # looked up now: compile may replace it
            self.pass_through -= 1
            hidden = args[0] if args else kwargs["hidden_states"]
            return hidden if self.rest is None else (hidden, *self.rest)

        return forward


def _is_cache(value: Any) -> bool:
    return any(cls.__name__ == "Cache" and cls.__module__.startswith("transformers") for cls in type(value).__mro__)


def _without_cache(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A key/value cache would be updated twice (forward and recomputation), so a
    checkpointed layer runs without one, as Hugging Face's own checkpointing does: cache
    objects (positional or keyword) become None and `use_cache` False."""
    if not any(map(_is_cache, (*args, *kwargs.values()))) and not kwargs.get("use_cache"):
        return args, kwargs
    global _cache_warned
    if not _cache_warned:
        log.warning("shardwise: checkpointed layers run without their key/value cache (use_cache=False): "
                    "a recomputation would update it a second time")
        _cache_warned = True
    args = tuple(None if _is_cache(value) else value for value in args)
    kwargs = {name: None if _is_cache(value) else value for name, value in kwargs.items()}
    return args, {**kwargs, **({"use_cache": False} if "use_cache" in kwargs else {})}


def _with_hidden(args: tuple, kwargs: dict, hidden: torch.Tensor) -> tuple:
    """(args, kwargs) of the next layer: the same, with the hidden states replaced."""
    if args:
        return (hidden, *args[1:]), kwargs
    return (), {**kwargs, "hidden_states": hidden}


def apply_activation_checkpointing(
    model: nn.Module,
    policy: RecomputePolicy | str = "full",
    *,
    layers: Sequence[nn.Module] | str | None = None,
    store: CheckpointStore | None = None,
    selective: str | SaveRule | None = None,
    stats: RegionStats | None = None,
    synchronize: bool = False,
) -> nn.Module:
    """Checkpoint `model`'s layers by `policy` ("full", "every_k", "selective", "sqrt" or a
    RecomputePolicy); returns the same model. `layers`: the stack (modules or a dotted
    name; default: found, layers.py). `store`: Pa / CPU / Md for the kept inputs (default:
    kept as they are). `selective`: the rule of the selective policy (selective.py)."""
    if isinstance(policy, str):
        policy = RecomputePolicy(policy)
    if getattr(model, MARK, None) is not None:
        raise RuntimeError(f"activation checkpointing is already applied to this model (policy "
                           f"{getattr(model, MARK).name!r}); apply it once")
    if getattr(model, "is_gradient_checkpointing", False):
        raise ValueError("the model has Hugging Face gradient checkpointing enabled as well; call "
                         "model.gradient_checkpointing_disable() or leave activation_checkpointing.policy unset")
    stack = resolve_layers(model, layers)
    store = store if store is not None else CheckpointStore()
    rule = save_rule(selective or policy.selective_rule) if policy.name == "selective" else None
    for indices in policy.regions(len(stack)):
        members = [stack[index] for index in indices]

        def run(chain: Callable, args: tuple, kwargs: dict, count: int = len(members)) -> Any:
            return run_checkpointed(chain, args, kwargs, store, save_rule=rule, layers=count, stats=stats,
                                    synchronize=synchronize)

        region = _Region(members, run)
        members[0].forward = region.leader
        for position, member in enumerate(members[1:], start=1):
            member.forward = region.follower(position)
    setattr(model, MARK, policy)
    setattr(model, STATS, stats)
    return model


def checkpoint_stats(model: nn.Module) -> RegionStats | None:
    """Seconds spent in checkpointed forwards and recomputations (with `stats` given, or
    the config's `activation_checkpointing.profile`)."""
    return getattr(model, STATS, None)
