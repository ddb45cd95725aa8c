"""Memory estimator and planner (C7): ZeRO model states, offload placement, activations,
and the fastest stage / offload / recomputation that fits the given hardware."""

from shardwise.formulas.memory import (
    Offload,
    model_state_bytes,
    optimizer_state_bytes,
    placed_model_state_bytes,
)
from shardwise.formulas.layers import activation_bytes
from shardwise.tools.planner.recommend import Estimate, Hardware, OptionEstimate, Recommendation, estimate
from shardwise.formulas.model_shape import ModelShape

__all__ = [
    "Estimate",
    "Hardware",
    "ModelShape",
    "Offload",
    "OptionEstimate",
    "Recommendation",
    "activation_bytes",
    "estimate",
    "model_state_bytes",
    "optimizer_state_bytes",
    "placed_model_state_bytes",
]
