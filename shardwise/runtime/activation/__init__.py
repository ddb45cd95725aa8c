"""Activation memory (C9, C10): recomputation policies, checkpoint storage (Pa, CPU, Md)
and the accounting of activation bytes. See apply.py for the entry point."""

from shardwise.runtime.activation.accounting import ActivationTracker, current_tracker
from shardwise.runtime.activation.apply import apply_activation_checkpointing
from shardwise.runtime.activation.checkpoint import RegionStats, run_checkpointed
from shardwise.runtime.activation.policy import POLICIES, ActivationPolicy, RecomputePolicy
from shardwise.runtime.activation.store import CheckpointStore

__all__ = [
    "POLICIES",
    "ActivationPolicy",
    "ActivationTracker",
    "CheckpointStore",
    "RecomputePolicy",
    "RegionStats",
    "apply_activation_checkpointing",
    "current_tracker",
    "run_checkpointed",
]
