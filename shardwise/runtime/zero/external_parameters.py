"""`register_external_parameters`: a module's forward reads parameters whose own module
never runs (C4).

Stage 3 gathers a unit when a module owning it runs. A fused loss breaks that rule: it
runs the backbone, then projects through the output embedding's weight itself, without
calling the head (TRL's fused LM head, which returns log-probabilities without building
the logits). At stage 3 that weight is an empty placeholder there. Registered, the units
holding such parameters are gathered with the reading module's own for its whole forward,
and again before its backward, where the gradient computed through them arrives: what
DeepSpeed's `register_external_parameter` does for its own hooks.
"""

from __future__ import annotations

from typing import Iterable

from torch import nn

from shardwise.runtime.zero.gathered import zero_of


def register_external_parameters(module: nn.Module, params: Iterable[nn.Parameter]) -> None:
    """From now on, `module`'s forward gathers `params` (stage 3; below it they are whole
    already). `module` must be trained by the engine holding them; call on every rank,
    before the forward."""
    by_engine = {}
    for param in params:
        zero = zero_of(param)
        if zero is None:
            raise ValueError("register_external_parameters() got a parameter that no shardwise engine holds")
        by_engine.setdefault(id(zero), (zero, []))[1].append(param)
    for zero, owned in by_engine.values():
        if zero.policy.partitions_parameters:
            zero.params.schedule.register_external(module, owned)
