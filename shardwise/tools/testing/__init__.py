"""Test support: run a function on several local ranks and surface any rank's failure."""

from shardwise.tools.testing.harness import DistributedTestError, run_distributed

__all__ = ["DistributedTestError", "run_distributed"]
