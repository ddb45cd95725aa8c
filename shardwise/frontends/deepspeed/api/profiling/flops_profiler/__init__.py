"""`deepspeed.profiling.flops_profiler`: `get_model_profile`, `FlopsProfiler` and the
number formats DeepSpeed prints its profiles in (profiler.py, units.py)."""

from shardwise.frontends.deepspeed.api.profiling.flops_profiler.profiler import FlopsProfiler, get_model_profile
from shardwise.frontends.deepspeed.api.profiling.flops_profiler.totals import (
    get_module_duration,
    get_module_flops,
    get_module_macs,
)
from shardwise.frontends.deepspeed.api.profiling.flops_profiler.units import (
    bytes_to_string,
    duration_to_string,
    flops_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
)

__all__ = ["FlopsProfiler", "bytes_to_string", "duration_to_string", "flops_to_string", "get_model_profile",
           "get_module_duration", "get_module_flops", "get_module_macs", "macs_to_string", "number_to_string",
           "params_to_string"]
