"""Activation memory (C9, C10): recomputation policies, checkpoint storage (Pa, CPU, Md)
and the accounting of activation bytes. See apply.py for the entry point."""

from shardwise.activation.accounting import ActivationTracker, current_tracker
from shardwise.activation.apply import apply_activation_checkpointing
from shardwise.activation.checkpoint import RegionStats, run_checkpointed
from shardwise.activation.policy import POLICIES, RecomputePolicy
from shardwise.activation.store import CheckpointStore

__all__ = [
    "POLICIES",
    "ActivationTracker",
    "CheckpointStore",
    "RecomputePolicy",
    "RegionStats",
    "apply_activation_checkpointing",
    "current_tracker",
    "run_checkpointed",
]
