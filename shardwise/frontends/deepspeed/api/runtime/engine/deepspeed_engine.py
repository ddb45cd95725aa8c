"""The engine `deepspeed.initialize` returns: the DeepSpeed-configured engine
(frontends/deepspeed/engine.py) with the few methods whose DeepSpeed shape differs from
shardwise's.

At the config's `flops_profiler.profile_step` (optimizer steps counted from 0), rank 0
profiles each forward with DeepSpeed's flops profiler and prints the profile at that
micro-batch's `step()`, as DeepSpeed's engine does (once per micro-batch of that step),
with the forward, backward and step times of the accumulation window so far, which
DeepSpeed reads from its wall-clock timers.

Why a subclass and not the base engine: shardwise's own callers (the training job, the
checkpoint tests) read `engine.gradient_accumulation_steps` as an int and get a dict
from `load_checkpoint`; DeepSpeed scripts call `engine.gradient_accumulation_steps()`
and unpack `path, client_state = engine.load_checkpoint(...)`. Each API keeps its
shape on the engine built for it. Everything else (the accessors both share, the
`nn.Module` pass-through to the model) is the base engine's.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Container

import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset, Sampler

from shardwise.runtime.checkpoint.format import LATEST
from shardwise.runtime.checkpoint.manifest import write_synced
from shardwise.runtime.checkpoint.state import capture_rng_state, restore_rng_state
from shardwise.frontends.deepspeed.api.profiling.flops_profiler.profiler import FlopsProfiler, synchronized_time
from shardwise.frontends.deepspeed.api.runtime.engine.checkpoint_arguments import agreed_location
from shardwise.frontends.deepspeed.config.written import (written_optimizer_name, written_setting,
                                                           written_value)
from shardwise.frontends.deepspeed.api.runtime.zero.external_parameters import ReturnedParameterTracker
from shardwise.frontends.deepspeed.api.runtime.zero.offload_config import OffloadDeviceEnum
from shardwise.frontends.deepspeed.api.runtime.zero.partition_parameters import mark_partitioned, unmark_partitioned
from shardwise.frontends.deepspeed.api.utils.repeating_loader import RepeatingLoader
from shardwise.frontends.deepspeed.api.utils.timer import ThroughputTimer
from shardwise.frontends.deepspeed.api.utils.zero_to_fp32 import RECOVERY_SCRIPT
from shardwise.frontends.deepspeed.config import ShardwiseConfig
from shardwise.frontends.deepspeed.config.deepspeed_keys import DATA_TYPE_NAMES
from shardwise.frontends.deepspeed.data_loader import (ROUTE_EVAL, ROUTE_PREDICT, ROUTE_TRAIN, DeepSpeedDataLoader,
                                                       PositionedSampler)
from shardwise.frontends.deepspeed.config.policies import DTYPES
from shardwise.frontends.deepspeed.engine import ConfiguredEngine
from shardwise.runtime.data.curriculum_loader import CurriculumDataLoader
from shardwise.runtime.data.difficulty_sampler import DifficultySampler
from shardwise.runtime.data.random_ltd import RandomLayerTokenDrop, RandomLTDState
from shardwise.runtime.data.token_schedule import RandomLTDScheduler
from shardwise.runtime.distributed.setup import call_check_timeout
from shardwise.runtime.engine import Job, Policies
from shardwise.runtime.precision.casting import to_device
from shardwise.runtime.zero.parked_states import StateKind
from shardwise.runtime.compile.blocks import compile_blocks, find_blocks
from shardwise.runtime.compile.policy import CompilePolicy
from shardwise.models.families import plan_for
from shardwise.frontends.deepspeed.api.accelerator import get_accelerator
from shardwise.runtime.parallel.pipeline.sequential import SequentialStages
from shardwise.runtime.parallel.pipeline.runner import take_micro_batches

log = logging.getLogger("shardwise")

PARTIAL_LOAD_REFUSED = (
    "a custom_load_fn is handed DeepSpeed's own checkpoint layout, which shardwise does not write; to "
    "transform trained weights, export them with `shardwise convert`, change them, and load them into the "
    "model before deepspeed.initialize"
)


class AccumulationSteps(int):
    """The number of micro-batches per update: an int to shardwise's code, and callable
    as DeepSpeed's `engine.gradient_accumulation_steps()`."""

    def __call__(self) -> int:
        return int(self)


@dataclass(frozen=True)
class ThroughputTimerSettings:
    """DeepSpeed's `timers.throughput` block (the config's `timers` key is accepted as
    diagnostics, shardwise/frontends/deepspeed/config/deepspeed_keys.py). Not synchronised,
    where DeepSpeed's default is: a device synchronisation at every forward and step would
    stall the host's run-ahead on a GPU for a number averaged over many steps anyway."""

    enabled: bool = True
    synchronized: bool = False


class DeepSpeedEngine(ConfiguredEngine):
    def __init__(self, model: nn.Module, *, config: ShardwiseConfig, job: Job, policies: Policies,
                 optimizer: torch.optim.Optimizer | None = None, lr_scheduler: Any = None,
                 param_init_fn: Callable[[nn.Module], None] | None = None):
        super().__init__(model, config=config, job=job, policies=policies, optimizer=optimizer,
                         lr_scheduler=lr_scheduler, param_init_fn=param_init_fn)
        self._step_applied = False
        self.training_dataloader = None  # set by initialize when it builds one
        self.collate_fn: Callable | None = None  # initialize's, deepspeed_io's default
        # DeepSpeed's samples-per-second meter: started when a micro-batch is read (by the
        # loader initialize built) or its forward begins, stopped at each step(); rank 0 logs
        # it every steps_per_print updates
        self.tput_timer = ThroughputTimer(ThroughputTimerSettings(), batch_size=self.train_batch_size(),
                                          steps_per_output=self.steps_per_print(), monitor_memory=False)
        self.tag_validation = "WARN"  # the config's checkpoint.tag_validation, set by initialize
        # what the script gave initialize, set by it: DeepSpeed's accessors answer from them
        self.client_optimizer: Any = None
        self.client_lr_scheduler: Any = None
        self.script_config: dict[str, Any] = {}  # the config as written, before shardwise resolved it
        self._returned_parameters: ReturnedParameterTracker | None = None
        if self.policies.zero.partitions_parameters:
            self._mark_partitioned()
            self._returned_parameters = ReturnedParameterTracker(self.module)  # module._external_params
        profiler = config.flops_profiler
        self.flops_profiler = (FlopsProfiler(self.module, self, profiler.recompute_fwd_factor)
                               if profiler.enabled else None)
        self._window_latencies = [0.0, 0.0, 0.0]  # forward, backward, step seconds in the profiled window
        self._batch_fn: Callable[[Any], Any] | None = None  # set_batch_fn's, applied to each micro-batch taken
        self._compiled_by_call = False  # compile() ran

    @property
    def dp_world_size(self) -> int:
        """The data-parallel size (DeepSpeed's attribute)."""
        return self.mesh.data_size

    @property
    def mp_world_size(self) -> int:
        """The model-parallel (tensor-parallel) size (DeepSpeed's attribute)."""
        return self.policies.tensor.size

    def get_data_parallel_rank(self) -> int:
        return self.mesh.data_rank

    def get_tensor_parallel_rank(self) -> int:
        return self.mesh["tensor"].rank

    def get_model_parallel_rank(self) -> int:
        """DeepSpeed's model-parallel rank is the tensor-parallel one (its `groups`)."""
        return self.get_tensor_parallel_rank()

    def get_sequence_parallel_group(self) -> Any:
        """The sequence-parallel process group; None without sequence parallelism (where
        DeepSpeed 0.19.8's engine never sets the attribute it returns)."""
        return self.mesh["sequence"].group if self.policies.sequence.size > 1 else None

    def get_batch_info(self) -> tuple[int, int, int]:
        """(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps).
        DeepSpeed 0.19.8 returns its three accessor methods themselves, not their values
        (its docstring promises the values); the values are what a script can use."""
        return (self.train_batch_size(), self.train_micro_batch_size_per_gpu(),
                int(self.gradient_accumulation_steps()))

    def save_fp16_model(self, save_dir: str | os.PathLike, save_filename: str = "pytorch_model.bin") -> bool:
        """DeepSpeed's older name of `save_16bit_model`, kept by DeepSpeed for old scripts."""
        return self.save_16bit_model(save_dir, save_filename)

    # -- DeepSpeed's accessors of the config as the script wrote it ----------------------------
    def optimizer_name(self) -> str | None:
        """The class name of the optimizer passed to initialize, else the config's
        `optimizer.type` as written (lower-cased for DeepSpeed's own optimizers: "adam")."""
        if self.client_optimizer is not None:
            return type(self.client_optimizer).__name__
        return written_optimizer_name(self.script_config)

    def optimizer_params(self) -> dict[str, Any] | None:
        """The config's `optimizer.params` as written (not the defaults shardwise filled in)."""
        block = self.script_config.get("optimizer") or {}
        return block.get("params") if "type" in block else None

    def scheduler_name(self) -> str | None:
        return (self.script_config.get("scheduler") or {}).get("type")

    def scheduler_params(self) -> dict[str, Any] | None:
        block = self.script_config.get("scheduler") or {}
        return block.get("params") if "type" in block else None

    def wall_clock_breakdown(self) -> bool:
        """The config's `wall_clock_breakdown`, which DeepSpeed also turns on for the flops profiler."""
        return bool(self.script_config.get("wall_clock_breakdown", False)) or self.config.flops_profiler.enabled

    def get_data_types(self) -> tuple[torch.dtype, torch.dtype]:
        """(the training dtype, the dtype gradients accumulate in): the config's
        `data_types.grad_accum_dtype` in any of DeepSpeed's spellings, else the training dtype."""
        model = torch.float16 if self.fp16_enabled() else torch.bfloat16 if self.bfloat16_enabled() else torch.float32
        accumulate = DATA_TYPE_NAMES.get((self.script_config.get("data_types") or {}).get("grad_accum_dtype"))
        return model, DTYPES[accumulate] if accumulate is not None else model

    def get_mom(self) -> list[Any]:
        """Each param group's momentum for an optimizer named SGD or RMSprop, else its betas
        (0.0 for a group without them), as DeepSpeed decides by `optimizer_name()`."""
        key = "momentum" if self.optimizer_name() in ("SGD", "RMSprop") else "betas"
        groups = self.optimizer.optimizer.param_groups if self.trains else []
        return [group.get(key, 0.0) for group in groups]

    # -- DeepSpeed's accessors of settings shardwise accepts without modelling them ---------------
    zero_allow_untested_optimizer = written_setting("zero_allow_untested_optimizer", False)
    zero_allgather_sequential = written_setting("zero_optimization.stage3_allgather_sequential", False,
                                                alias="zero_optimization.allgather_sequential")
    zero_compute_grad_norm = written_setting("zero_optimization.compute_grad_norm", True)
    zero_elastic_checkpoint = written_setting("zero_optimization.elastic_checkpoint", False)
    zero_legacy_stage1 = written_setting("zero_optimization.legacy_stage1", False)
    zero_load_from_fp32_weights = written_setting("zero_optimization.load_from_fp32_weights", True)
    zero_log_trace_cache_warnings = written_setting("zero_optimization.log_trace_cache_warnings", False)
    zero_model_persistence_threshold = written_setting(
        "zero_optimization.stage3_model_persistence_threshold", sys.maxsize,
        alias="zero_optimization.model_persistence_threshold")
    zero_multi_rank_bucket_allreduce = written_setting("zero_optimization.use_multi_rank_bucket_allreduce", True)
    zero_parameter_alignment = written_setting("zero_optimization.parameter_alignment", False)
    zero_quantized_nontrainable_weights = written_setting("zero_optimization.zero_quantized_nontrainable_weights",
                                                          False)
    zero_round_robin_gradients = written_setting("zero_optimization.round_robin_gradients", False)
    zero_save_muon_momentum_buffer_in_memory = written_setting(
        "zero_optimization.save_muon_momentum_buffer_in_memory", False)
    is_sanity_checks_enabled = written_setting("zero_optimization.enable_sanity_checks", False)
    super_offload = written_setting("zero_optimization.offload_optimizer.super_offload", False)
    zero_force_ds_cpu_optimizer = written_setting("zero_force_ds_cpu_optimizer", True)
    fp16_master_weights_and_gradients = written_setting("fp16.fp16_master_weights_and_grads", False)
    autotp_size = written_setting("tensor_parallel.autotp_size", 0)
    checkpoint_serialization_enabled = written_setting("checkpoint.checkpoint_serialization", True)
    use_node_local_storage = written_setting("checkpoint.use_node_local_storage", False)
    load_universal_checkpoint = written_setting("checkpoint.load_universal", False)
    gradient_predivide_factor = written_setting("gradient_predivide_factor", 1.0)
    optimizer_legacy_fusion = written_setting("optimizer.legacy_fusion", False)
    dump_state = written_setting("dump_state", False)

    def cpuadam_cores_perc(self) -> float:
        """The offload block's `cpuadam_cores_perc`: DeepSpeed 0.19.8's default is 0.8 in an
        `offload_optimizer` block and 0.9 without one."""
        block = written_value(self.script_config, "zero_optimization.offload_optimizer", None)
        return written_value(block, "cpuadam_cores_perc", 0.8) if isinstance(block, dict) else 0.9

    def managed_gradient_accumulation(self) -> bool:
        """False: every step() ends the accumulation window (the config's key, honoured)."""
        return not self.policies.training.caller_ends_windows

    def postscale_gradients(self) -> bool:
        return not written_value(self.script_config, "prescale_gradients", False)

    def torch_autocast_lower_precision_safe_modules(self) -> list[str]:
        """The config's list as written, else DeepSpeed's default: the module classes whose
        gradients DeepSpeed reduces in the autocast dtype (shardwise reduces every gradient
        in communication_data_type: config/deepspeed_keys.py)."""
        written = written_value(self.script_config, "torch_autocast.lower_precision_safe_modules", None)
        return written if written is not None else [f"{kind.__module__}.{kind.__name__}"
                                                    for kind in (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)]

    def aio_config(self) -> dict[str, Any]:
        """The config's `aio` block with DeepSpeed's defaults filled in."""
        return {key: written_value(self.script_config, f"aio.{key}", default) for key, default in (
            ("block_size", 1_048_576), ("queue_depth", 8), ("intra_op_parallelism", 1), ("single_submit", False),
            ("overlap_events", True), ("use_gds", False))}

    # -- the flops profiler, as DeepSpeed's engine runs it ---------------------------------------
    def flops_profiler_enabled(self) -> bool:
        return self.flops_profiler is not None

    def _profiling_this_step(self) -> bool:
        return (self.flops_profiler is not None and self.global_steps == self.config.flops_profiler.profile_step
                and self.global_rank == 0)

    def profiled_latencies(self) -> tuple[float, float, float]:
        """Seconds of forward, backward and step in the profiled accumulation window so far."""
        forward, backward, step = self._window_latencies
        return forward, backward, step

    def _timed(self, phase: int, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`call(...)`, its time added to the profiled window's `phase` (0 forward, 1 backward, 2 step)."""
        started = synchronized_time()
        try:
            return call(*args, **kwargs)
        finally:
            self._window_latencies[phase] += synchronized_time() - started

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The base engine's forward; profiled at the profile step (module docstring)."""
        if getattr(self.training_dataloader, "tput_timer", None) is not self.tput_timer:  # else the loader starts it
            self.tput_timer.start()
        if not self._profiling_this_step():
            return super().forward(*args, **kwargs)
        self.flops_profiler.start_profile(ignore_list=None)
        try:
            return self._timed(0, super().forward, *args, **kwargs)
        finally:
            self.flops_profiler.stop_profile()

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        if self._profiling_this_step():
            return self._timed(1, super().backward, loss, retain_graph, scale_wrt_gas)
        return super().backward(loss, retain_graph, scale_wrt_gas)

    def _print_flops_profile(self) -> None:
        """After a profiled forward's `step()`: the profile, at the step count `step()` left."""
        settings = self.config.flops_profiler
        self.flops_profiler.print_model_profile(profile_step=self.global_steps, module_depth=settings.module_depth,
                                                top_modules=settings.top_modules, detailed=settings.detailed,
                                                output_file=settings.output_file)
        self.flops_profiler.end_profile()

    # -- ZeRO-3 as DeepSpeed shows it to user code ---------------------------------------------
    def _mark_partitioned(self) -> None:
        """DeepSpeed's `ds_*` attributes on every parameter (runtime/zero/partition_parameters.py):
        full shapes from the unit holding each one; a parameter still whole now, outside any
        forward, is one ZeRO-3 keeps whole (`ds_persist`)."""
        slots = {id(slot.param): slot for unit in self.zero.unit_of_param.values() for slot in unit.slots}
        marked = []
        for param in self.module.parameters():
            slot = slots.get(id(param))
            shape = slot.shape if slot is not None else param.shape
            marked.append((param, shape, param.data.numel() == shape.numel()))
        mark_partitioned(marked)

    def empty_partition_cache(self) -> None:
        """Release every gathered ZeRO-3 parameter (those kept whole stay), as DeepSpeed's
        does with the parameters it caches between steps; at other stages, nothing to release."""
        self.zero.release_gathered()

    # -- torch.compile as DeepSpeed's engine.compile() asks for it ----------------------------
    def compile(self, backend: Any = None, compile_kwargs: dict[str, Any] | None = None, schedule: Any = None,
                compiled_autograd_enabled: bool = False) -> None:
        """DeepSpeed's `engine.compile()`: `torch.compile` with `backend` (default the
        accelerator's) and `compile_kwargs`, applied per repeated block as `compile.enabled`
        does (runtime/compile/blocks.py: ZeRO-3's gathers stay outside the graphs), where
        DeepSpeed compiles the whole module. A model without repeated blocks is compiled
        whole at stages 0-2. Once compiled, a second call does nothing, as in DeepSpeed.
        `schedule` is DeepCompile's, which shardwise runs as per-block compilation too;
        compiled autograd is not used (the backward runs ZeRO's hooks eagerly)."""
        if self.is_compiled:
            return
        compile_kwargs = dict(compile_kwargs or {})
        if "backend" in compile_kwargs:
            log.warning("The `backend` in `compile_kwargs` will be overridden. Use the `backend` argument instead.")
            compile_kwargs.pop("backend")
        if compiled_autograd_enabled:
            log.info("shardwise: engine.compile(compiled_autograd_enabled=True): the backward runs eagerly, "
                     "through ZeRO's gradient hooks; only the forward blocks are compiled")
        backend = backend if backend is not None else get_accelerator().get_compile_backend()
        policy = CompilePolicy(enabled=True, backend=backend, kwargs=compile_kwargs)
        layers = plan_for(self.module).layers
        blocks = list(self.module.get_submodule(layers)) if layers else find_blocks(self.module)
        if not blocks:
            if self.policies.zero.partitions_parameters:
                raise ValueError(
                    f"engine.compile() at ZeRO stage 3 compiles each repeated block of the model, with ZeRO's "
                    f"gathers between them; {type(self.module).__name__} has none (no `_no_split_modules` class, "
                    "no nn.ModuleList of one class): compile its repeated submodules yourself before "
                    "deepspeed.initialize, or train at stage 0-2, where the whole module is compiled")
            blocks = [self.module]
        compile_blocks(self.module, policy, blocks)
        self._compiled_by_call = True

    @property
    def is_compiled(self) -> bool:
        """Whether the model's blocks run compiled: by `compile()`, or by the config's
        `compile.enabled` when the engine was built."""
        return self._compiled_by_call or self.policies.compile.enabled

    def offload_states(self, include: Container[Any] | None = None, device: Any = OffloadDeviceEnum.cpu,
                       pin_memory: bool = True, non_blocking: bool = False) -> None:
        """DeepSpeed's signature over the engine's `offload_states` (runtime/zero/parked_states.py):
        `include` of DeepSpeed's `OffloadStateTypeEnum` (or their names); only the host as
        the `device`, as DeepSpeed allows; "none" moves nothing, with DeepSpeed's warning."""
        device = OffloadDeviceEnum(getattr(device, "value", device))
        if device == OffloadDeviceEnum.none:
            log.warning("No device specified for offloading states.")
            return
        if device == OffloadDeviceEnum.nvme:
            raise ValueError("NVMe offload is not supported for offloading states.")
        kinds = None if include is None else [StateKind(getattr(kind, "value", kind)) for kind in include]
        super().offload_states(kinds, pin_memory=pin_memory, non_blocking=non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        super().reload_states(non_blocking=non_blocking)

    def destroy(self) -> None:
        super().destroy()
        unmark_partitioned(self.module.parameters())
        if self._returned_parameters is not None:
            self._returned_parameters.remove()

    # -- random-LTD as DeepSpeed's engine runs it (data_routing/helper.py wraps the layers) ----
    @property
    def random_ltd_scheduler(self) -> RandomLTDScheduler | None:
        return self.random_ltd.scheduler if self.random_ltd is not None else None

    def random_ltd_enabled(self) -> bool:
        return self.policies.random_ltd is not None

    def random_ltd_initialize(self) -> None:
        """Attach the model's RandomLayerTokenDrop wrappers as DeepSpeed 0.19.8 does: walking
        the modules in order, a wrapper whose name contains the next of the sorted
        `random_ltd_layer_id` (as text) becomes the next dropping layer; the other wrappers
        run their layer on all tokens."""
        policy = self.policies.random_ltd
        if policy is None:
            raise ValueError("random_ltd_initialize(): data_efficiency.data_routing.random_ltd.enabled is false in "
                             "the config; enable it (with its layers and schedule) to drop tokens")
        state = self.random_ltd or RandomLTDState(policy, data_rank=self.mesh.data_rank)
        queue = sorted(policy.layer_ids)
        count = 0
        for name, wrapper in self.module.named_modules():
            if not isinstance(wrapper, RandomLayerTokenDrop):
                continue
            if queue and str(queue[0]) in name:
                wrapper.attach(state, count, wrapper.kept_inputs)
                queue.pop(0)
                count += 1
            else:
                wrapper.random_ltd_state, wrapper.random_ltd_scheduler = None, None
        if count != len(policy.layer_ids):
            raise ValueError(f"random_ltd_layer_num {len(policy.layer_ids)} must equal the number of wrapped layers "
                             f"whose names contain random_ltd_layer_id {sorted(policy.layer_ids)}: found {count}")
        self.random_ltd = state

    def checkpoint_tag_validation_enabled(self) -> bool:
        return self.tag_validation != "IGNORE"

    def checkpoint_tag_validation_fail(self) -> bool:
        return self.tag_validation == "FAIL"

    @property
    def gradient_accumulation_steps(self) -> AccumulationSteps:
        return AccumulationSteps(self.__dict__["_accumulation_steps"])

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, value: int) -> None:
        self.__dict__["_accumulation_steps"] = int(value)

    def step(self, lr_kwargs: dict | None = None) -> None:
        """shardwise's step; records whether it updated the weights (`was_step_applied`)."""
        if lr_kwargs is not None:
            raise ValueError("engine.step(lr_kwargs=...) is not supported: the engine steps the scheduler "
                             "without arguments after each update")
        updates, skipped = self.global_steps, self.skipped_steps
        profiled, boundary = self._profiling_this_step(), self.is_gradient_accumulation_boundary()
        if profiled:
            self._timed(2, super().step)
            self._print_flops_profile()
        else:
            super().step()
        if boundary:
            self._window_latencies = [0.0, 0.0, 0.0]
        self._step_applied = self.global_steps > updates and self.skipped_steps == skipped
        self.tput_timer.stop(global_step=boundary, report_speed=boundary and self.global_rank == 0)

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """DeepSpeed's: the global batch becomes `train_batch_size` samples by changing the
        number of micro-batches per update (the micro-batch size stays), as Megatron-DeepSpeed's
        batch-size ramp-up calls it before each iteration. Called between accumulation
        windows; the next window has the new count. DeepSpeed 0.19.8 counts its windows from
        the run's first micro-batch, so its first window after a change can end early (after
        2 micro-batches of 2, a change to 3 ends the next window after 1, its loss still
        divided by 3); shardwise counts the windows trained so far in the new size instead,
        so every window is whole. The size it already has is accepted anywhere (Megatron-DeepSpeed
        calls it at every iteration, pipelines included)."""
        per_step = self.train_micro_batch_size_per_gpu() * self.dp_world_size
        if not isinstance(train_batch_size, int) or train_batch_size < 1 or train_batch_size % per_step:
            raise ValueError(f"set_train_batch_size({train_batch_size!r}): the train batch size must be a positive "
                             f"multiple of train_micro_batch_size_per_gpu x data-parallel size = {per_step}")
        steps = train_batch_size // per_step
        if steps == self.gradient_accumulation_steps:  # the ramp-up's calls at a constant size change nothing
            return
        into_window = self.micro_steps % self.gradient_accumulation_steps
        if into_window or self._backward_pending:
            raise RuntimeError(f"set_train_batch_size in the middle of an accumulation window "
                               f"({into_window + int(self._backward_pending)} "
                               f"micro-batch(es) of {self.gradient_accumulation_steps} taken): call it after the "
                               "window's last step()")
        fixed = ("a pipeline runs the micro-batch count its schedule was built for" if self.pipeline is not None
                 else "ZenFlow accumulates over its own update interval" if self.zenflow is not None
                 else "the curriculum sampler draws whole batches of the configured size"
                 if self.policies.data_sampling is not None else None)
        if fixed is not None:
            raise ValueError(f"set_train_batch_size is not supported here: {fixed}; set train_batch_size in the "
                             "config instead")
        self.micro_steps = self.micro_steps // self.gradient_accumulation_steps * steps
        self.gradient_accumulation_steps = steps
        self.loss_divisor = steps
        self.config = self.config.model_copy(update={"train_batch_size": train_batch_size,
                                                     "gradient_accumulation_steps": steps})
        self.tput_timer.batch_size = train_batch_size

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        """DeepSpeed's: the micro-batches the script feeds from now on hold `micro_batch_size`
        samples, the accumulation steps stay, so the global batch becomes micro-batch x
        accumulation x data-parallel size (the config's numbers, the throughput timer's and
        the monitors' sample counts follow). The loaders already built keep their size, in
        DeepSpeed too. Refused with a pipeline (its buffers are shaped for the configured
        micro-batch) and the curriculum sampler (it draws micro-batches of the configured size)."""
        if not isinstance(micro_batch_size, int) or micro_batch_size < 1:
            raise ValueError(f"set_train_micro_batch_size({micro_batch_size!r}): give a positive number of samples")
        fixed = ("a pipeline's buffers are shaped for the configured micro-batch" if self.pipeline is not None
                 else "the curriculum sampler draws micro-batches of the configured size"
                 if self.policies.data_sampling is not None else None)
        if fixed is not None:
            raise ValueError(f"set_train_micro_batch_size is not supported here: {fixed}; set "
                             "train_micro_batch_size_per_gpu in the config instead")
        train_batch_size = micro_batch_size * self.gradient_accumulation_steps * self.dp_world_size
        self.config = self.config.model_copy(update={"train_batch_size": train_batch_size,
                                                     "train_micro_batch_size_per_gpu": micro_batch_size})
        self.tput_timer.batch_size = train_batch_size

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """DeepSpeed's: the caller says whether the next backward ends the accumulation
        window, and calls `step()` at window ends only (accelerate's DeepSpeed wrapper does).
        shardwise counts micro-batches in `step()`, so a micro-batch whose `step()` was left
        out is counted here, and a window the caller ends early (an epoch's short last
        window) ends here too."""
        if self.policies.training.caller_ends_windows:
            raise RuntimeError("set_gradient_accumulation_boundary() is not supported with "
                               "managed_gradient_accumulation false: every step() ends the window there "
                               "(DeepSpeed 0.19.8 refuses it too)")
        if self._backward_pending:  # the previous micro-batch's step(), inside its window
            if self.is_gradient_accumulation_boundary():
                raise RuntimeError("engine.set_gradient_accumulation_boundary: the previous micro-batch ended an "
                                   "accumulation window but step() was not called after its backward")
            self.step()
        steps = self.gradient_accumulation_steps
        if is_boundary and not self.is_gradient_accumulation_boundary():
            self.micro_steps += steps - 1 - self.micro_steps % steps
        elif not is_boundary and self.is_gradient_accumulation_boundary():
            raise RuntimeError(f"the caller continues an accumulation window past the config's "
                               f"gradient_accumulation_steps ({steps}); make the two equal")

    def was_step_applied(self) -> bool:
        """Whether the last `step()` updated the weights: False between accumulation
        boundaries and when an fp16 overflow skipped the update."""
        return self._step_applied

    def save_checkpoint(self, save_dir: str | os.PathLike, tag: str | None = None, client_state: dict | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
        """DeepSpeed's signature; returns True. `client_state` must be JSON (shardwise
        checkpoints hold no pickles). `save_latest=False` leaves `save_dir/latest` naming
        the checkpoint it named before (rank 0 puts it back once every rank has saved).
        `exclude_frozen_parameters` (the Hugging Face Trainer's for a PEFT model): the
        parameters nothing trains are left out; such a checkpoint loads with
        `load_module_strict=False`, as the Trainer resumes it."""
        self.world.agree_on_call("save_checkpoint", call_check_timeout(self.context.timeout))
        save_dir, tag = agreed_location(self.world, "save_checkpoint", save_dir, tag,
                                        tag_validation=self.tag_validation)
        latest = Path(save_dir) / LATEST
        previous = latest.read_text() if not save_latest and latest.is_file() else None
        # save_latest=False puts `latest` back once the checkpoint is published, so it waits for it
        super().save_checkpoint(save_dir, tag, client_state, asynchronous=False if not save_latest else None,
                                exclude_frozen_parameters=exclude_frozen_parameters)
        if not save_latest and self.rank == 0:
            if previous is None:
                latest.unlink()
            else:
                temporary = Path(save_dir) / f".{LATEST}.partial"
                write_synced(temporary, previous)
                os.replace(temporary, latest)
        if self.policies.zero.partitions_model_states and self.rank == 0:  # DeepSpeed leaves its recovery script
            script = Path(save_dir) / "zero_to_fp32.py"
            write_synced(script.with_name(script.name + ".partial"), RECOVERY_SCRIPT)
            os.replace(script.with_name(script.name + ".partial"), script)
        if not save_latest:
            self.world.barrier("save_checkpoint(save_latest=False)")  # no rank reads `latest` before it is put back
        return True

    def load_checkpoint(self, load_dir: str | os.PathLike, tag: str | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Any = None) -> tuple[str | None, dict | None]:
        """Resume from `load_dir/tag` (tag None: the one `latest` names); returns
        (checkpoint directory, client_state), or (None, None) with a warning when there
        is no `latest` to follow, as DeepSpeed does. As in DeepSpeed, the random number
        generators keep their state (shardwise's own load_checkpoint restores the saved
        one), so a script that seeds and then resumes draws what it drew under DeepSpeed.

        `load_optimizer_states=False` loads the weights and keeps this engine's optimizer
        state; `load_module_only=True` loads only the weights; `load_module_strict=False`
        loads into a model with more or fewer tensors (those missing keep their values;
        restoring the optimizer state then needs every trained parameter in the
        checkpoint). A `custom_load_fn` is refused: it would receive DeepSpeed's own
        checkpoint layout."""
        if custom_load_fn is not None:
            raise ValueError(f"load_checkpoint(custom_load_fn) is not supported: {PARTIAL_LOAD_REFUSED}")
        self.world.agree_on_call("load_checkpoint", call_check_timeout(self.context.timeout))
        load_dir, tag = agreed_location(self.world, "load_checkpoint", load_dir, tag,
                                        tag_validation=self.tag_validation)
        if tag is None and not (Path(load_dir) / LATEST).is_file():
            log.warning("load_checkpoint: no file %s: nothing loaded; pass tag= to load a particular checkpoint",
                        Path(load_dir) / LATEST)
            return None, None
        scheduler_state = None
        if not load_lr_scheduler_states and self.lr_scheduler is not None:
            scheduler_state = self.lr_scheduler.state_dict()
        random_state = capture_rng_state(self.device)
        client_state = super().load_checkpoint(load_dir, tag, optimizer_states=load_optimizer_states,
                                               module_only=load_module_only, strict=load_module_strict)
        restore_rng_state(random_state, self.device)  # DeepSpeed leaves the random generators alone
        if scheduler_state is not None:
            self.lr_scheduler.load_state_dict(scheduler_state)
        directory = Path(load_dir) / (tag if tag is not None else (Path(load_dir) / LATEST).read_text().strip())
        return str(directory), client_state

    # -- DeepSpeed's data loaders ----------------------------------------------------------------
    @staticmethod
    def is_map_style_dataset(obj: Any) -> bool:
        return hasattr(obj, "__getitem__") and hasattr(obj, "__len__")

    @staticmethod
    def is_iterable_style_dataset(obj: Any) -> bool:
        return isinstance(obj, IterableDataset)

    def deepspeed_io(self, dataset: Dataset, batch_size: int | None = None, route: str = ROUTE_TRAIN,
                     pin_memory: bool = True, data_sampler: Sampler | None = None, collate_fn: Callable | None = None,
                     num_local_io_workers: int | None = None) -> DeepSpeedDataLoader | CurriculumDataLoader:
        """DeepSpeed's loader of `dataset` for this rank: micro-batches of `batch_size`
        (default the config's micro-batch size) through `collate_fn` (default the one
        given to `initialize`), each data-parallel rank reading its share. Its order is
        DeepSpeed's: without `data_sampler`, a DistributedSampler shuffled with seed 0
        for the "train" route (DeepSpeed's curriculum sampler where the config's
        `data_efficiency.data_sampling` is on) and in order for "eval" and "predict".
        The "train" route's loader starts the throughput timer as it reads each batch.

        Which loader the checkpoints follow: the one `initialize` built from
        `training_data`; a loader from here is the script's (DeepSpeed keeps no loader's
        position). Pinned memory only where the engine's device is a GPU; worker processes
        only as many as `num_local_io_workers` says (frontends/deepspeed/data_loader.py says why).
        An IterableDataset is refused: DeepSpeed's loader samples by index (and fails on
        one with a TypeError)."""
        if self.is_iterable_style_dataset(dataset) or not self.is_map_style_dataset(dataset):
            raise ValueError(f"engine.deepspeed_io needs a map-style torch Dataset (with __len__ and __getitem__), "
                             f"as DeepSpeed's loader samples it by index; got {type(dataset).__name__}. Build a "
                             "DataLoader for an iterable dataset yourself, each rank reading its own share")
        if route not in (ROUTE_TRAIN, ROUTE_EVAL, ROUTE_PREDICT):
            raise ValueError(f"engine.deepspeed_io(route={route!r}): the routes are {ROUTE_TRAIN!r}, {ROUTE_EVAL!r} "
                             f"and {ROUTE_PREDICT!r}")
        batch_size = self.train_micro_batch_size_per_gpu() if batch_size is None else batch_size
        collate_fn = self.collate_fn if collate_fn is None else collate_fn
        replicas, drop_last = self.comm, self.config.dataloader_drop_last
        sampling = self.policies.data_sampling
        if route == ROUTE_TRAIN and data_sampler is None and sampling is not None:
            sampler = DifficultySampler(sampling, samples=len(dataset), micro_batch_size=batch_size,
                                        gradient_accumulation_steps=int(self.gradient_accumulation_steps),
                                        replicas=replicas, drop_last=drop_last)
            return CurriculumDataLoader(dataset, sampler=sampler, collate_fn=collate_fn,
                                        num_workers=sampling.num_workers, pin_memory=sampling.pin_memory)
        if data_sampler is None:
            data_sampler = PositionedSampler(dataset, num_replicas=replicas.size, rank=replicas.rank,
                                             drop_last=drop_last, shuffle=route == ROUTE_TRAIN)
        loader = DeepSpeedDataLoader(dataset, batch_size=batch_size, sampler=data_sampler, collate_fn=collate_fn,
                                     drop_last=drop_last, num_workers=num_local_io_workers or 0,
                                     pin_memory=pin_memory and self.device.type == "cuda")
        if route == ROUTE_TRAIN:
            loader.tput_timer = self.tput_timer
        return loader

    # -- DeepSpeed's PipelineEngine ----------------------------------------------------------
    def set_data_post_process_func(self, post_process_func: Callable[[Any, dict], Any]) -> None:
        """DeepSpeed's hook on the curriculum loader's batches: `post_process_func(batch,
        sampler_state)` returns the batch to train on (runtime/data/curriculum_loader.py)."""
        if self.training_dataloader is not None:
            self.training_dataloader.post_process_func = post_process_func

    def set_custom_curriculum_learning_schedule(self, schedule_func_dict: dict[str, Callable[[int], Any]]) -> None:
        """The difficulty functions of the metrics with schedule_type "custom", by metric name."""
        if isinstance(self.training_dataloader, CurriculumDataLoader):
            self.training_dataloader.data_sampler.set_custom_curriculum_learning_schedule(schedule_func_dict)

    def curriculum_learning_enabled(self) -> bool:
        return self.policies.data_sampling is not None

    def set_dataiterator(self, iterator: Any) -> None:
        """The iterator `train_batch()` / `eval_batch()` pull micro-batches from when given none."""
        self._data_iterator = iterator

    def set_dataloader(self, loader: Any) -> None:
        """DeepSpeed's PipelineEngine's: `loader` becomes the training loader, and
        `train_batch()` / `eval_batch()` without an iterator read it from its start."""
        self.training_dataloader = loader
        self._data_iterator = iter(loader)

    def set_batch_fn(self, fn: Callable[[Any], Any] | None) -> None:
        """DeepSpeed's PipelineEngine's: each micro-batch `train_batch()` / `eval_batch()`
        take is passed through `fn` first (Megatron-DeepSpeed builds its pipeline inputs
        from the raw batch this way)."""
        self._batch_fn = fn

    def reset_activation_shape(self) -> None:
        """DeepSpeed's PipelineEngine drops its cached activation shapes when the sequence
        length changes (curriculum learning); shardwise's pipeline caches none: each step
        sends the shapes its receivers cannot derive (runtime/parallel/pipeline/p2p.py)."""

    def train_batch(self, data_iter: Any = None, loss_fn: Any = None) -> torch.Tensor:
        """One global batch (gradient_accumulation_steps micro-batches) and one optimizer
        step; without `data_iter`, from `set_dataiterator`'s iterator or, as DeepSpeed does,
        from the loader `initialize` built from `training_data`, restarted when it ends."""
        data_iter = self._micro_batches(data_iter, "train_batch")
        if self.pipeline is not None:
            return super().train_batch(data_iter, loss_fn)
        return self._sequential_batch(data_iter, loss_fn, train=True)

    def eval_batch(self, data_iter: Any = None, loss_fn: Any = None) -> torch.Tensor:
        data_iter = self._micro_batches(data_iter, "eval_batch")
        if self.pipeline is not None:
            return super().eval_batch(data_iter, loss_fn)
        return self._sequential_batch(data_iter, loss_fn, train=False)

    def _micro_batches(self, data_iter: Any, call: str) -> Any:
        data_iter = self._unprocessed_micro_batches(data_iter, call)
        return data_iter if self._batch_fn is None else map(self._batch_fn, data_iter)

    def _unprocessed_micro_batches(self, data_iter: Any, call: str) -> Any:
        if data_iter is not None:
            return data_iter
        if getattr(self, "_data_iterator", None) is None and self.training_dataloader is not None:
            self._data_iterator = iter(RepeatingLoader(self.training_dataloader))
        if getattr(self, "_data_iterator", None) is None:
            raise ValueError(f"engine.{call}() without data_iter needs training_data passed to deepspeed.initialize "
                             "or engine.set_dataiterator(iterator)")
        return self._data_iterator

    def _sequential_batch(self, data_iter: Any, loss_fn: Any, train: bool) -> torch.Tensor:
        """A PipelineModule with one stage: DeepSpeed still trains it with train_batch; here
        that is gradient accumulation over the same micro-batches."""
        loss_fn = loss_fn if loss_fn is not None else getattr(self.module, "loss_fn", None)
        if not isinstance(self.module, SequentialStages):
            raise RuntimeError("engine.train_batch() runs a pipeline: pass a PipelineModule (or set "
                               "pipeline_parallel.size > 1), or train with engine(batch), engine.backward(loss) "
                               "and engine.step()")
        was_training = self.module.training
        self.module.train(train and was_training)
        losses = []
        try:
            for inputs, labels in take_micro_batches(data_iter, self.gradient_accumulation_steps):
                inputs, labels = to_device((inputs, labels), self.device)
                with torch.enable_grad() if train else torch.no_grad():
                    output = self(inputs)
                    loss = output if loss_fn is None else loss_fn(output, labels)
                if train:
                    self.backward(loss)
                    self.step()
                losses.append(loss.detach().float())
        finally:
            self.module.train(was_training)
        mean = torch.stack(losses).mean().reshape(1).double().cpu()
        self.comm.control_all_reduce(mean, "the batch's loss over the data-parallel group")
        return (mean / self.comm.size)[0].float()
