"""Data efficiency's random-LTD in numbers (docs/formulas.md#random-ltd): tokens the
dropping layers keep at a step, and the layer-tokens a step processes, as DeepSpeed 0.19.8
counts them (deepspeed/runtime/data_pipeline/data_routing/scheduler.py)."""

from __future__ import annotations

import math


def random_ltd_kept_tokens(step: int, *, min_value: int, max_value: int, require_steps: int,
                           seq_per_step: int) -> int:
    """`fixed_linear`: floor(step / require_steps · (max − min) + min), rounded down to a
    multiple of seq_per_step, at most max (and not raised back to min after rounding)."""
    kept = math.floor(float(step) / require_steps * (max_value - min_value) + min_value)
    return min(kept - kept % seq_per_step, max_value)


def random_ltd_layer_tokens(kept: int, *, max_value: int, layers: int, dropping_layers: int,
                            global_batch: int) -> int:
    """Layer-tokens of one optimizer step: every sample runs `kept` tokens through each
    dropping layer and `max_value` through the others (DeepSpeed's consumed_layer_tokens
    increment; with max_value the sequence length, the tokens the layers compute on)."""
    return global_batch * (kept * dropping_layers + max_value * (layers - dropping_layers))
