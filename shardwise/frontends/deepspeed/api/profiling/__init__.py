"""`deepspeed.profiling`: the flops profiler (flops_profiler/)."""

from shardwise.frontends.deepspeed.api.profiling import flops_profiler

__all__ = ["flops_profiler"]
