"""The flops profile as DeepSpeed 0.19.8 prints it: the summary, the top modules per depth,
and the model printed with each module's numbers. Scripts and people grep these lines,
so the wording and the number formats are DeepSpeed's (units.py).

The forward latency is the model's forward time as the module hooks measured it, or, for
an engine that timed the step, the engine's forward time with the backward and step
latencies after it (DeepSpeed's engine prints those from its wall-clock timers, which the
profiler switches on)."""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Any

from torch import nn

from shardwise.frontends.deepspeed.api.moe.layer import MoE
from shardwise.frontends.deepspeed.api.profiling.flops_profiler.units import (
    DEFAULT_PRECISION,
    duration_to_string,
    flops_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
)
from shardwise.frontends.deepspeed.api.profiling.flops_profiler.totals import (
    get_module_duration,
    get_module_flops,
    get_module_macs,
)

if TYPE_CHECKING:
    from shardwise.frontends.deepspeed.api.profiling.flops_profiler.profiler import FlopsProfiler

__all__ = ["print_aggregated_profile", "print_profile"]

_NOTATIONS = ("Notations:\n"
              "data parallel size (dp_size), model parallel size(mp_size),\n"
              "number of parameters (params), number of multiply-accumulate operations(MACs),\n"
              "number of floating-point operations (flops), floating-point operations per second (FLOPS),\n"
              "fwd latency (forward propagation latency), bwd latency (backward propagation latency),\n"
              "step (weights update latency), iter latency (sum of fwd, bwd and step latency)\n")
_DETAILED_NOTE = (
    "Each module profile is listed after its name in the following order: \nparams, percentage of total params, "
    "MACs, percentage of total MACs, fwd latency, percentage of total fwd latency, fwd FLOPS")
_MODULE_NOTE = (
    "\nNote: 1. A module can have torch.nn.module or torch.nn.functional to compute logits (e.g. CrossEntropyLoss). "
    "They are not counted as submodules, thus not to be printed out. However they make up the difference between a "
    "parent's MACs (or latency) and the sum of its submodules'.\n2. Number of floating-point operations is a "
    "theoretical estimation, thus FLOPS computed using that could be larger than the maximum system throughput.\n3. "
    "The fwd latency listed in the top module's profile is directly captured at the module forward function in "
    "PyTorch, thus it's less than the fwd latency shown above which is captured in DeepSpeed.\n")


def _line(label: str, value: Any) -> str:
    """A summary line; the value formatted as DeepSpeed does (a bool prints as 1 or 0)."""
    return "{:<70}  {:<8}".format(label, value)


def _percent(part: float, total: float) -> float:
    return round(100 * part / total, DEFAULT_PRECISION) if total else 0


def print_profile(profiler: FlopsProfiler, *, profile_step: int, module_depth: int, top_modules: int, detailed: bool,
                  output_file: str | None) -> None:
    """The whole profile, to `output_file` (its folder made) when given, else stdout."""
    if not output_file:
        _print_profile(profiler, profile_step, module_depth, top_modules, detailed)
        return
    os.makedirs(os.path.dirname(os.path.abspath(output_file)), exist_ok=True)
    with open(output_file, "w") as file, contextlib.redirect_stdout(file):
        _print_profile(profiler, profile_step, module_depth, top_modules, detailed)


def _print_profile(profiler: FlopsProfiler, profile_step: int, module_depth: int, top_modules: int,
                   detailed: bool) -> None:
    model, engine = profiler.model, profiler.ds_engine
    total_flops, total_macs = profiler.get_total_flops(), profiler.get_total_macs()
    total_duration, total_params = profiler.get_total_duration(), profiler.get_total_params()
    has_moe = any(isinstance(module, MoE) for module in model.modules())
    model_parallel = engine.mp_world_size if engine is not None else 1
    expert_tensor_parallel = 1
    model_params = model_expert_params = 0
    if engine is not None:
        model_params = model.__params__ * model_parallel
        if has_moe:
            if any(getattr(module, "enable_expert_tensor_parallelism", False)
                   for module in model.modules() if isinstance(module, MoE)):
                expert_tensor_parallel = model_parallel
            model_expert_params = model.__model_expert_params__ * expert_tensor_parallel

    print("\n-------------------------- DeepSpeed Flops Profiler --------------------------")
    print(f"Profile Summary at step {profile_step}:")
    print(_NOTATIONS)
    if engine is not None:
        print(_line("world size: ", engine.world_size))
        print(_line("data parallel size: ", engine.dp_world_size))
        print(_line("model parallel size: ", model_parallel))
        print(_line("batch size per GPU: ", engine.train_micro_batch_size_per_gpu()))
        if has_moe:
            print(_line("expert tensor parallelism enabled: ", expert_tensor_parallel > 1))
    print(_line("params per GPU: ", params_to_string(total_params)))
    if model_expert_params > 0:
        print(_line("params of model: ", params_to_string(model_params + model_expert_params)))
        print(_line("   non-expert params of model: ", params_to_string(model_params)))
        print(_line("   expert params of model: ", params_to_string(model_expert_params)))
    else:
        print(_line("params of model = params per GPU * mp_size: ", params_to_string(model_params)))
    print(_line("fwd MACs per GPU: ", macs_to_string(total_macs)))
    print(_line("fwd flops per GPU: ", number_to_string(total_flops)))
    print(_line("fwd flops of model = fwd flops per GPU * mp_size: ", number_to_string(total_flops * model_parallel)))
    latencies = engine.profiled_latencies() if engine is not None else None
    forward = latencies[0] if latencies is not None else total_duration
    print(_line("fwd latency: ", duration_to_string(forward)))
    print(_line("fwd FLOPS per GPU = fwd flops per GPU / fwd latency: ", flops_to_string(total_flops / forward)))
    if latencies is not None:
        _print_step_latencies(latencies, total_flops, 2 + profiler.recompute_fwd_factor,
                              engine.train_micro_batch_size_per_gpu() * engine.world_size)

    print("\n----------------------------- Aggregated Profile per GPU -----------------------------")
    print_aggregated_profile(model, module_depth=module_depth, top_modules=top_modules)
    if detailed:
        print("\n------------------------------ Detailed Profile per GPU ------------------------------")
        print(_DETAILED_NOTE)
        print(_MODULE_NOTE)
        with _profile_in_repr(model, total_params, total_macs, total_duration):
            print(model)
    print("------------------------------------------------------------------------------")


def _print_step_latencies(latencies: tuple[float, float, float], forward_flops: int, backward_factor: float,
                          samples: int) -> None:
    """DeepSpeed's lines from its wall-clock timers: backward as `backward_factor` forwards."""
    forward, backward, step = latencies
    iteration = forward + backward + step
    print(_line("bwd latency: ", duration_to_string(backward)))
    print(_line(f"bwd FLOPS per GPU = {backward_factor:g} * fwd flops per GPU / bwd latency: ",
                flops_to_string(backward_factor * forward_flops / backward)))
    print(_line(f"fwd+bwd FLOPS per GPU = {backward_factor + 1:g} * fwd flops per GPU / (fwd+bwd latency): ",
                flops_to_string((backward_factor + 1) * forward_flops / (forward + backward))))
    print(_line("step latency: ", duration_to_string(step)))
    print(_line("iter latency: ", duration_to_string(iteration)))
    print(_line(f"FLOPS per GPU = {backward_factor + 1:g} * fwd flops per GPU / iter latency: ",
                flops_to_string((backward_factor + 1) * forward_flops / iteration)))
    print(_line("samples/second: ", round(samples / iteration, DEFAULT_PRECISION)))


def _module_profile(module: nn.Module, total_params: int, total_macs: int, total_duration: float) -> str:
    """A module's numbers as DeepSpeed prints them in place of its `extra_repr`."""
    params = module.__params__ + module.__expert_params__
    flops, macs, duration = get_module_flops(module), get_module_macs(module), get_module_duration(module)
    return ", ".join([
        f"{params_to_string(params)} = {_percent(params, total_params):g}% Params",
        f"{macs_to_string(macs)} = {_percent(macs, total_macs):g}% MACs",
        f"{duration_to_string(duration)} = {_percent(duration, total_duration):g}% latency",
        flops_to_string(round(flops / duration, DEFAULT_PRECISION) if duration else 0),
    ])


@contextlib.contextmanager
def _profile_in_repr(model: nn.Module, total_params: int, total_macs: int, total_duration: float):
    """Each module's `extra_repr` prefixed with its numbers while the model is printed."""
    replaced = []
    for module in model.modules():
        original = module.extra_repr

        def extra_repr(module: nn.Module = module, original: Any = original) -> str:
            own = original()
            profile = _module_profile(module, total_params, total_macs, total_duration)
            return f"{profile}, {own}" if own else profile

        replaced.append((module, module.__dict__.get("extra_repr")))
        module.extra_repr = extra_repr
    try:
        yield
    finally:
        for module, instance_attribute in replaced:
            if instance_attribute is None:
                del module.__dict__["extra_repr"]
            else:
                module.extra_repr = instance_attribute


def print_aggregated_profile(model: nn.Module, *, module_depth: int, top_modules: int) -> None:
    """Per depth, the `top_modules` module types with the most parameters, MACs and
    latency (a type's modules at that depth summed), depths 0 to `module_depth` - 1
    (-1: to the deepest but one, as DeepSpeed prints)."""
    if not hasattr(model, "__flops__"):
        print("no __flops__ attribute in the model, call this function after start_profile and before end_profile")
        return
    per_depth: list[dict[str, list[float]]] = []

    def walk(module: nn.Module, depth: int) -> None:
        if depth == len(per_depth):
            per_depth.append({})
        sums = per_depth[depth].setdefault(type(module).__name__, [0, 0, 0])  # MACs, params, latency
        sums[0] += get_module_macs(module)
        sums[1] += module.__params__ + module.__expert_params__
        sums[2] += get_module_duration(module)
        for child in module.children():
            walk(child, depth + 1)

    walk(model, 0)
    depth = len(per_depth) - 1 if module_depth == -1 else module_depth
    print(f"Top {top_modules} modules in terms of params, MACs or fwd latency at different model depths:")
    for level in range(min(depth, len(per_depth))):
        sums = per_depth[level]
        count = min(top_modules, len(sums))

        def top(column: int, to_string: Any) -> dict[str, str]:
            ranked = sorted(sums.items(), key=lambda item: item[1][column], reverse=True)[:count]
            return {name: to_string(values[column]) for name, values in ranked}

        print(f"depth {level}:")
        print(f"    params      - {top(1, params_to_string)}")
        print(f"    MACs        - {top(0, macs_to_string)}")
        print(f"    fwd latency - {top(2, duration_to_string)}")
