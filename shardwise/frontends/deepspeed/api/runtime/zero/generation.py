"""`deepspeed.runtime.zero.unwrap_model_for_generation`: hold every ZeRO-3 parameter whole
for a block, so generation (many forwards of one token each) gathers the weights once
instead of once per forward; RLHF loops (TRL, DeepSpeed-Chat) generate inside it.

DeepSpeed also removes its forward hooks for the block and re-registers them after;
shardwise's gather is reference-counted, so the hooks stay and find the units already
whole. Below stage 3 the parameters are whole anyway and the block only yields."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from shardwise.frontends.deepspeed.api.runtime.zero.partition_parameters import GatheredParameters

__all__ = ["unwrap_model_for_generation"]


@contextmanager
def unwrap_model_for_generation(model: Any) -> Iterator[Any]:
    """`model` is the engine `deepspeed.initialize` returned (or its module); yields it, its
    parameters whole."""
    with GatheredParameters(list(getattr(model, "module", model).parameters())):
        yield model
