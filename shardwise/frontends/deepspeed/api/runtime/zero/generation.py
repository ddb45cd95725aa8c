"""`deepspeed.runtime.zero.unwrap_model_for_generation`: hold every ZeRO-3 parameter whole
for a block, so generation (many forwards of one token each) gathers the weights once
instead of once per forward; RLHF loops (TRL, DeepSpeed-Chat) generate inside it.

DeepSpeed also removes its forward hooks for the block and re-registers them after;
shardwise's stage-3 schedule stands aside for the block (zero/gathered.py's
`gathered_for_generation`), so each rank may run as many forwards as its own sequences
need (ranks whose completions end at different lengths) with no collective between them.
Below stage 3 the parameters are whole anyway and the block only yields."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from shardwise.runtime.zero.gathered import gathered_for_generation

__all__ = ["unwrap_model_for_generation"]


@contextmanager
def unwrap_model_for_generation(model: Any) -> Iterator[Any]:
    """`model` is the engine `deepspeed.initialize` returned (or its module); yields it, its
    parameters whole."""
    with gathered_for_generation(getattr(model, "module", model).parameters()):
        yield model
