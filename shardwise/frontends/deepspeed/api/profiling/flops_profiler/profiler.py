"""`deepspeed.profiling.flops_profiler.profiler`: the floating-point operations, MACs,
parameters and latency of a model's forward, per module, as DeepSpeed's flops profiler
reports them.

DeepSpeed counts by patching `torch.nn.functional` and a few `torch` functions for the
profile's duration, each with a formula of its own. Here torch counts: a
`torch.utils.flop_counter.FlopCounterMode` is active from `start_profile` to
`stop_profile`. It sees every operator the forward dispatches, whatever Python function
called it (an `x @ w` operator, a fused kernel, a Hugging Face layer), and patches
nothing, so code holding a reference to `torch.nn.functional.linear` is counted too and
nothing is left patched when a forward raises. It counts the matrix products only (mm,
addmm, bmm, baddbmm, convolutions, attention), each as 2 floating-point operations per
multiply-accumulate, so here FLOPs = 2 x MACs. DeepSpeed's MACs are the same products;
its FLOPs add its own estimates for element-wise functions (activations, softmax, norms,
`torch.add` / `torch.mul`, an addmm's bias), which torch does not count:
docs/deepspeed.md#flops-profiler has both on a small GPT and a Llama.

Per module, as DeepSpeed attaches them between `start_profile` and `end_profile`:
`__flops__` and `__macs__` are the module's own operations (those inside its submodules
are theirs; `get_module_flops(module)` sums a module and its submodules),
`__params__` its and its submodules' parameters (expert parameters, those of a
`group_name` "ep_size_<n>", in `__expert_params__`), `__duration__` the wall time of its
forwards, the accelerator synchronised before and after. A module whose type is in
`ignore_list` gets no hooks: its operations count as its parent's, as in DeepSpeed.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count
from torch.utils.hooks import RemovableHandle

from shardwise.frontends.deepspeed.api.profiling.flops_profiler.report import print_aggregated_profile, print_profile
from shardwise.frontends.deepspeed.api.profiling.flops_profiler.totals import (
    get_module_duration,
    get_module_flops,
    get_module_macs,
)
from shardwise.frontends.deepspeed.api.profiling.flops_profiler.units import (
    duration_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
)
from shardwise.frontends.deepspeed.api.utils.timer import synchronize_accelerator

__all__ = ["FlopsProfiler", "get_model_profile", "get_module_duration", "get_module_flops", "get_module_macs",
           "synchronized_time"]

_PROFILE_ATTRIBUTES = ("__flops__", "__macs__", "__params__", "__expert_params__", "__model_expert_params__",
                       "__start_time__", "__duration__")
_EXPERT_GROUP_PREFIX = "ep_size_"  # DeepSpeed's MoE names its experts' parameter groups ep_size_<n>


def _cpu_attention_flops(query: torch.Size, key: torch.Size, value: torch.Size, *args: Any, out_val: Any = None,
                         **kwargs: Any) -> int:
    """torch's attention formula for the CPU kernel, which torch's table leaves out (it
    lists the CUDA kernels only): without it attention on the CPU would count nothing."""
    return sdpa_flop_count(query, key, value)


_EXTRA_FORMULAS = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention_flops}


def synchronized_time() -> float:
    """The time once the accelerator has finished its queued work, so an interval between
    two readings holds the kernels launched in it."""
    synchronize_accelerator()
    return time.time()


def _parameter_counts(module: nn.Module) -> tuple[int, int, int]:
    """(parameters, expert parameters, expert parameters times their expert-parallel size)."""
    params = experts = model_experts = 0
    for param in module.parameters():
        group = getattr(param, "group_name", "")
        expert_parallel = 0
        if isinstance(group, str) and group.startswith(_EXPERT_GROUP_PREFIX):
            try:
                expert_parallel = int(group[len(_EXPERT_GROUP_PREFIX):])
            except ValueError:
                pass
        if expert_parallel:
            experts += param.numel()
        else:
            params += param.numel()
        model_experts += param.numel() * expert_parallel
    return params, experts, model_experts


class FlopsProfiler:
    """DeepSpeed's profiler of a model's forward (module docstring for what it counts):

        prof = FlopsProfiler(model)
        prof.start_profile()
        loss = model(batch)
        flops = prof.get_total_flops()
        prof.print_model_profile(profile_step=step)
        prof.end_profile()

    `ds_engine`: the engine training `model`; its layout is printed in the profile, and
    when it timed the step (`ds_engine.profiled_latencies()`, as DeepSpeed's wall-clock
    timers do with the profiler on) the forward, backward and step latencies and their
    FLOPS, the backward counted as `2 + recompute_fwd_factor` forwards."""

    def __init__(self, model: nn.Module, ds_engine: Any = None, recompute_fwd_factor: float = 0.0):
        if ds_engine is not None and not hasattr(ds_engine, "profiled_latencies"):
            raise TypeError(f"FlopsProfiler(ds_engine=...) takes the engine deepspeed.initialize returned, got "
                            f"{type(ds_engine).__name__}; leave ds_engine out to profile the model alone")
        self.model = model
        self.ds_engine = ds_engine
        self.recompute_fwd_factor = recompute_fwd_factor
        self.started = False
        self._counter: FlopCounterMode | None = None
        self._handles: list[RemovableHandle] = []
        self._running: list[list[int]] = []  # per hooked module in its forward: [flops at entry, its children's flops]

    def start_profile(self, ignore_list: Sequence[type] | None = None) -> None:
        """Reset every module's numbers and count from here: hooks on each module whose type
        is not in `ignore_list`, torch's counter active until `stop_profile`."""
        self.stop_profile()
        self.reset_profile()
        for module in self.model.modules():
            if ignore_list and type(module) in ignore_list:
                continue
            self._handles.append(module.register_forward_pre_hook(self._enter))
            self._handles.append(module.register_forward_hook(self._leave))
        self._counter = FlopCounterMode(display=False, custom_mapping=_EXTRA_FORMULAS)
        self._counter.__enter__()
        self.started = True

    def stop_profile(self) -> None:
        """Stop counting; the numbers stay on the modules until `end_profile`."""
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            self._counter = None
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._running.clear()

    def reset_profile(self) -> None:
        """Zero every module's numbers; its parameters counted now."""
        for module in self.model.modules():
            module.__flops__ = module.__macs__ = 0
            module.__params__, module.__expert_params__, module.__model_expert_params__ = _parameter_counts(module)
            module.__start_time__ = module.__duration__ = 0

    def end_profile(self) -> None:
        """Stop counting and remove the numbers from the modules."""
        if not self.started:
            return
        self.stop_profile()
        self.started = False
        for module in self.model.modules():
            for name in _PROFILE_ATTRIBUTES:
                module.__dict__.pop(name, None)

    @torch.compiler.disable
    def _enter(self, module: nn.Module, inputs: Any) -> None:
        if module is self.model:  # a new forward: forget what one that raised left running
            self._running.clear()
        self._running.append([self._counter.get_total_flops(), 0])
        module.__start_time__ = synchronized_time()

    @torch.compiler.disable
    def _leave(self, module: nn.Module, inputs: Any, output: Any) -> None:
        module.__duration__ += synchronized_time() - module.__start_time__
        entry, children = self._running.pop()
        inside = self._counter.get_total_flops() - entry
        own = inside - children
        module.__flops__ += own
        module.__macs__ += own // 2  # every operation torch counts is a multiply-accumulate: 2 flops each
        if self._running:
            self._running[-1][1] += inside

    def get_total_flops(self, as_string: bool = False) -> int | str:
        total = get_module_flops(self.model)
        return number_to_string(total) if as_string else total

    def get_total_macs(self, as_string: bool = False) -> int | str:
        total = get_module_macs(self.model)
        return macs_to_string(total) if as_string else total

    def get_total_duration(self, as_string: bool = False) -> float | str:
        total = get_module_duration(self.model)
        return duration_to_string(total) if as_string else total

    def get_total_params(self, as_string: bool = False) -> int | str:
        """The parameters this rank holds (under ZeRO-3, its partitions), experts included."""
        total = self.model.__expert_params__ + self.model.__params__
        return params_to_string(total) if as_string else total

    def print_model_profile(self, profile_step: int = 1, module_depth: int = -1, top_modules: int = 1,
                            detailed: bool = True, output_file: str | None = None) -> None:
        """Print DeepSpeed's profile (summary, aggregated profile, and with `detailed` the
        model printed with each module's numbers) to stdout or `output_file`; nothing
        unless profiling started."""
        if self.started:
            print_profile(self, profile_step=profile_step, module_depth=module_depth, top_modules=top_modules,
                          detailed=detailed, output_file=output_file)

    def print_model_aggregated_profile(self, module_depth: int = -1, top_modules: int = 1) -> None:
        """The `top_modules` module types with the most parameters, MACs and latency at each depth."""
        print_aggregated_profile(self.model, module_depth=module_depth, top_modules=top_modules)


def get_model_profile(model: nn.Module, input_shape: tuple[int, ...] | None = None, args: Sequence[Any] | None = None,
                      kwargs: dict[str, Any] | None = None, print_profile: bool = True, detailed: bool = True,
                      module_depth: int = -1, top_modules: int = 1, warm_up: int = 1, as_string: bool = True,
                      output_file: str | None = None, ignore_modules: Sequence[type] | None = None,
                      mode: str = "forward") -> tuple[Any, Any, Any]:
    """(flops, MACs, parameters) of one forward (`mode="generate"`: one `model.generate`) of
    `model` in eval mode, after `warm_up` unprofiled ones; as DeepSpeed's strings when
    `as_string`. The input: `args` / `kwargs`, or with `input_shape` one uninitialised
    tensor of that shape in the model's dtype and device, as DeepSpeed makes it."""
    args, kwargs = list(args or ()), dict(kwargs or {})
    if not isinstance(model, nn.Module):
        raise TypeError(f"get_model_profile: model must be a torch.nn.Module, got {type(model).__name__}")
    if mode not in ("forward", "generate"):
        raise ValueError(f"get_model_profile: mode must be 'forward' or 'generate', got {mode!r}")
    if input_shape is not None:
        if not isinstance(input_shape, tuple) or not input_shape:
            raise ValueError(f"get_model_profile: input_shape must be a non-empty tuple, got {input_shape!r}")
        first = next(model.parameters(), None)
        args = [torch.empty(input_shape, dtype=first.dtype if first is not None else None,
                            device=first.device if first is not None else None)]
    if not args and not kwargs:
        raise ValueError("get_model_profile: give the model's input as input_shape, args or kwargs")
    run = model.generate if mode == "generate" else model
    profiler = FlopsProfiler(model)
    model.eval()
    for _ in range(warm_up):
        run(*args, **kwargs)
    profiler.start_profile(ignore_list=ignore_modules)
    try:
        run(*args, **kwargs)
    finally:
        profiler.stop_profile()
    flops, macs, params = profiler.get_total_flops(), profiler.get_total_macs(), profiler.get_total_params()
    if print_profile:
        profiler.print_model_profile(profile_step=warm_up, module_depth=module_depth, top_modules=top_modules,
                                     detailed=detailed, output_file=output_file)
    profiler.end_profile()
    if as_string:
        return number_to_string(flops), macs_to_string(macs), params_to_string(params)
    return flops, macs, params
