"""The engine `shardwise.initialize` returns for a DeepSpeed config: the runtime's engine,
plus the config it was built from and the accessors DeepSpeed's engine offers (C26).

Scripts written for DeepSpeed ask their engine what it was configured with
(`engine.fp16_enabled()`, `engine.train_micro_batch_size_per_gpu()`, `engine.local_rank`...)
and save a consolidated 16-bit model with `engine.save_16bit_model(dir)`. These read the
resolved config and the engine's state, so they answer the same on an engine built by
`shardwise.initialize` and on one built by DeepSpeed's `initialize` (api/runtime/engine/deepspeed_engine.py, whose
subclass also gives the names whose DeepSpeed shape differs from shardwise's:
`gradient_accumulation_steps()` as a method, `load_checkpoint` returning a tuple).

The config's monitor blocks (tensorboard, csv_monitor, wandb, comet) are attached here:
after every optimizer step, rank 0 writes DeepSpeed's series (frontends/deepspeed/monitors/).
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from shardwise.frontends.deepspeed.call_arguments import folder_problem, name_problem, raise_on_every_rank
from shardwise.frontends.deepspeed.checkpoints.detect import deepspeed_checkpoint_dir
from shardwise.frontends.deepspeed.checkpoints.resume import open_deepspeed_checkpoint
from shardwise.frontends.deepspeed.checkpoints.to_deepspeed import SUB_GROUP_SIZE, write_deepspeed_checkpoint
from shardwise.frontends.deepspeed.config import ShardwiseConfig
from shardwise.frontends.deepspeed.config.deepspeed_keys import DATA_TYPE_NAMES
from shardwise.frontends.deepspeed.config.policies import DTYPES
from shardwise.frontends.deepspeed.config.schema import OffloadOptimizerConfig, OffloadParamConfig, ZenFlowConfig
from shardwise.frontends.deepspeed.monitors import MonitorMaster, step_events
from shardwise.runtime.checkpoint.format import CheckpointError
from shardwise.runtime.checkpoint.load import OpenedCheckpoint
from shardwise.runtime.engine import Engine, Job, Policies
from shardwise.runtime.zero.gathered import gathered_parameters

log = logging.getLogger("shardwise")

_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


class ConfiguredEngine(Engine):
    """An engine built from a DeepSpeed config: `engine.config` is the resolved config."""

    def __init__(self, model: nn.Module, *, config: ShardwiseConfig, job: Job, policies: Policies,
                 optimizer: torch.optim.Optimizer | None = None, lr_scheduler: Any = None,
                 param_init_fn: Callable[[nn.Module], None] | None = None):
        """`config`: what the policies were made from (frontends/deepspeed/config/policies.py);
        the rest as `Engine`'s."""
        super().__init__(model, job=job, policies=policies, optimizer=optimizer, lr_scheduler=lr_scheduler,
                         param_init_fn=param_init_fn)
        self.config = config
        self.global_samples = 0  # samples trained, DeepSpeed's x axis: train_batch_size per optimizer step
        self.monitor = MonitorMaster(config, self.rank)
        self._window_losses: list[torch.Tensor] = []  # this step's micro-batch losses, for the monitors
        self._in_train_batch = False

    # -- monitors: DeepSpeed's series after every optimizer step ---------------------------
    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """DeepSpeed's: `scale_wrt_gas=False` leaves the loss undivided by the accumulation
        steps (the script averaged it itself, as verl's and other RL trainers do). Returns
        the loss as divided, as DeepSpeed's does."""
        if self.monitor.enabled:
            self._window_losses.append(loss.detach())
        super().backward(loss, retain_graph=retain_graph, averaged=scale_wrt_gas)
        return loss / self.loss_divisor if scale_wrt_gas else loss

    def step(self) -> None:
        steps, backwards = self.global_steps, self.backwards_in_window
        super().step()
        if self.global_steps > steps:
            # a window the caller ends holds as many micro-batches as it ran (DeepSpeed counts them so)
            self.global_samples += (self.config.train_batch_size // self.gradient_accumulation_steps * backwards
                                    if self.policies.training.caller_ends_windows else self.config.train_batch_size)
            if not self._in_train_batch:
                self._write_monitor()

    def train_batch(self, data_iter: Any = None, loss_fn: Any = None) -> torch.Tensor:
        """The pipeline's step, whose mean loss the monitors write once it is known."""
        self._in_train_batch = True
        try:
            loss = super().train_batch(data_iter, loss_fn)
        finally:
            self._in_train_batch = False
        if self.monitor.enabled:
            self._window_losses = [loss.detach()]
            self._write_monitor()
        return loss

    def _write_monitor(self) -> None:
        if not self.monitor.enabled:
            return
        losses, self._window_losses = self._window_losses, []
        loss = torch.stack([value.float().cpu() for value in losses]).mean().item() if losses else None
        self.monitor.write_events(step_events(
            samples=self.global_samples, lr=self.get_lr()[0] if self.get_lr() else None, loss=loss,
            loss_scale=self.loss_scaler.scale if self.policies.precision.loss_scaling is not None else None))

    def destroy(self) -> None:
        self.monitor.close()
        super().destroy()

    @property
    def global_rank(self) -> int:
        """This process's rank in the whole job (DeepSpeed's name for `engine.rank`)."""
        return self.rank

    @property
    def local_rank(self) -> int:
        """This process's rank on its node (LOCAL_RANK), which picks its device."""
        return self.context.local_rank

    # -- DeepSpeed's config accessors: what the config says, as DeepSpeed 0.19.8 answers ------
    def fp16_enabled(self) -> bool:
        return self.config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        return self.config.bf16.enabled

    def fp16_auto_cast(self) -> bool:
        return self.config.fp16.auto_cast

    def bf16_master_weights_and_gradients(self) -> bool:
        return self.config.bf16.bf16_master_weights_and_grads

    def bf16_optimizer_states(self) -> bool:
        return self.config.bf16.bf16_optimizer_states

    def loss_scale(self) -> float:
        """The configured `fp16.loss_scale`: 0 means dynamic scaling, as in DeepSpeed (whose
        engine answers the config here too). The scale in use now is `loss_scaler.scale`."""
        return self.config.fp16.loss_scale

    def dynamic_loss_scale(self) -> bool:
        return self.config.fp16.loss_scale == 0

    def initial_dynamic_scale(self) -> int:
        return 2**self.config.fp16.initial_scale_power

    def dynamic_loss_scale_args(self) -> dict[str, Any]:
        """The dynamic scaler's settings under DeepSpeed's names (answered whether or not
        fp16 is on, as DeepSpeed does)."""
        fp16 = self.config.fp16
        return {"init_scale": 2**fp16.initial_scale_power, "scale_window": fp16.loss_scale_window,
                "delayed_shift": fp16.hysteresis, "consecutive_hysteresis": fp16.consecutive_hysteresis,
                "min_scale": fp16.min_loss_scale}

    @property
    def communication_data_type(self) -> torch.dtype:
        """The dtype gradients are reduced in: the config's `communication_data_type`, else
        the training dtype (fp16, bf16, or fp32)."""
        return self.policies.precision.communication_dtype

    @communication_data_type.setter
    def communication_data_type(self, dtype: torch.dtype | str) -> None:
        """DeepSpeed lets a script change the reduction dtype after initialize; shardwise's
        reducer was built for the configured one, so only that same dtype is accepted."""
        wanted = DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
        if wanted != self.communication_data_type:
            raise ValueError(f"engine.communication_data_type = {dtype}: the gradients are reduced in "
                             f"{self.communication_data_type}, fixed when the engine was built; set "
                             f'"communication_data_type": "{_DTYPE_NAMES.get(wanted, wanted)}" in the config instead')

    def train_batch_size(self) -> int:
        """Samples per optimizer step over all data-parallel ranks."""
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def steps_per_print(self) -> int | None:
        """The config's `steps_per_print`; None where the config leaves it out, DeepSpeed
        0.19.8's default (its engine then prints no progress or throughput lines)."""
        return self.config.steps_per_print if "steps_per_print" in self.config.model_fields_set else None

    def dataloader_drop_last(self) -> bool:
        return self.config.dataloader_drop_last

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    def zero_optimization(self) -> bool:
        """Whether ZeRO is on (stage 1-3)."""
        return self.stage > 0

    def zero_optimization_stage(self) -> int:
        return self.stage

    def zero_optimization_partition_gradients(self) -> bool:
        return self.stage >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return self.stage >= 3

    def zero_offload_optimizer(self) -> OffloadOptimizerConfig | None:
        """The config's `zero_optimization.offload_optimizer` block (`.device`, `.ratio`...);
        None where the config has none, as in DeepSpeed."""
        zero = self.config.zero_optimization
        return zero.offload_optimizer if "offload_optimizer" in zero.model_fields_set else None

    def zero_offload_param(self) -> OffloadParamConfig | None:
        zero = self.config.zero_optimization
        return zero.offload_param if "offload_param" in zero.model_fields_set else None

    def zero_use_cpu_optimizer(self) -> bool:
        """Whether the optimizer steps on the host (its states offloaded to the CPU or NVMe)."""
        return self.config.zero_optimization.offload_optimizer.device in ("cpu", "nvme")

    def zero_cpu_offload(self) -> bool:
        return self.config.zero_optimization.offload_optimizer.device == "cpu"

    def zero_partial_offload(self) -> float:
        return self.config.zero_optimization.offload_optimizer.ratio

    def zero_reduce_scatter(self) -> bool:
        return self.config.zero_optimization.reduce_scatter

    def zero_overlap_comm(self) -> bool:
        return self.config.zero_optimization.overlap_comm

    def zero_contiguous_gradients(self) -> bool:
        return self.config.zero_optimization.contiguous_gradients

    def zero_reduce_bucket_size(self) -> int:
        return self.config.zero_optimization.reduce_bucket_size

    def zero_allgather_partitions(self) -> bool:
        return self.config.zero_optimization.allgather_partitions

    def zero_allgather_bucket_size(self) -> int:
        return self.config.zero_optimization.allgather_bucket_size

    def zero_sub_group_size(self) -> int:
        return self.config.zero_optimization.sub_group_size

    def zero_prefetch_bucket_size(self) -> int:
        return self.config.zero_optimization.stage3_prefetch_bucket_size

    def zero_param_persistence_threshold(self) -> int:
        return self.config.zero_optimization.stage3_param_persistence_threshold

    def zero_max_live_parameters(self) -> int:
        return self.config.zero_optimization.stage3_max_live_parameters

    def zero_max_reuse_distance(self) -> int:
        return self.config.zero_optimization.stage3_max_reuse_distance

    def zero_module_granularity_threshold(self) -> int:
        return self.config.zero_optimization.stage3_module_granularity_threshold

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        return self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save

    def zero_ignore_unused_parameters(self) -> bool:
        return self.config.zero_optimization.ignore_unused_parameters

    def zero_hpz_partition_size(self) -> int:
        return self.config.zero_optimization.zero_hpz_partition_size

    def zero_quantized_weights(self) -> bool:
        return self.config.zero_optimization.zero_quantized_weights

    def zero_quantized_gradients(self) -> bool:
        return self.config.zero_optimization.zero_quantized_gradients

    def zenflow_config(self) -> ZenFlowConfig | None:
        return self.config.zero_optimization.zenflow

    def data_efficiency_enabled(self) -> bool:
        return self.config.data_efficiency.enabled

    def autotuning_enabled(self) -> bool:
        return self.config.autotuning.enabled

    def autotuning_start_profile_step(self) -> int:
        return self.config.autotuning.start_profile_step

    def autotuning_end_profile_step(self) -> int:
        return self.config.autotuning.end_profile_step

    def autotuning_metric(self) -> str:
        return self.config.autotuning.metric

    def autotuning_metric_path(self) -> str:
        """The config's `autotuning.metric_path`, else autotuning_metric.json in the working directory."""
        return self.config.autotuning.metric_path or os.path.join(os.getcwd(), "autotuning_metric.json")

    def autotuning_model_info_path(self) -> str:
        return self.config.autotuning.model_info_path or os.path.join(os.getcwd(), "autotuning_model_info.json")

    def autotuning_profile_model_info(self) -> bool:
        autotuning = self.config.autotuning
        return autotuning.enabled and autotuning.model_info is not None and autotuning.model_info.profile

    def flops_profiler_profile_step(self) -> int:
        return self.config.flops_profiler.profile_step

    def flops_profiler_module_depth(self) -> int:
        return self.config.flops_profiler.module_depth

    def flops_profiler_top_modules(self) -> int:
        return self.config.flops_profiler.top_modules

    def flops_profiler_detailed(self) -> bool:
        return self.config.flops_profiler.detailed

    def flops_profiler_output_file(self) -> str | None:
        return self.config.flops_profiler.output_file

    def flops_profiler_recompute_fwd_factor(self) -> float:
        return self.config.flops_profiler.recompute_fwd_factor

    def torch_autocast_enabled(self) -> bool:
        return self.config.torch_autocast.enabled

    def torch_autocast_dtype(self) -> torch.dtype | None:
        """The config's `torch_autocast.dtype` as a torch dtype; None where it names none."""
        name = self.config.torch_autocast.dtype
        return DTYPES[DATA_TYPE_NAMES[name]] if name is not None else None

    def data_sampling_enabled(self) -> bool:
        return self.config.data_efficiency.data_sampling.enabled

    def checkpoint_writer_enabled(self) -> bool:
        return self.config.checkpoint.writer is not None

    def zero_nvme_offload_optimizer(self) -> bool:
        return self.config.zero_optimization.offload_optimizer.device == "nvme"

    def is_first_weights_partition_group(self) -> bool:
        """DeepSpeed 0.19.8's answer: whether the weights are partitioned (stage 3)."""
        return self.stage >= 3

    def is_deepcompile_enabled(self) -> bool:
        return self.config.compile.deepcompile

    @property
    def sequence_parallel_size(self) -> int:
        return self.policies.sequence.size

    @property
    def seq_dp_world_size(self) -> int:
        """The ranks one gradient is averaged over: data- times sequence-parallel size."""
        return self.mesh.data_size * self.policies.sequence.size

    def get_global_grad_norm(self) -> float | None:
        """Norm of the whole (unscaled, unclipped) gradient at the last update; None
        before the first one."""
        return self.last_grad_norm

    def load_checkpoint(self, load_dir: str | os.PathLike, tag: str | None = None, *,
                        optimizer_states: bool = True, module_only: bool = False, strict: bool = True,
                        trust_pickles: bool = False) -> dict:
        """The engine's `load_checkpoint`, which also resumes DeepSpeed's own checkpoints
        (recognised by their files: frontends/deepspeed/checkpoints/): weights, fp32 masters,
        optimizer state, scheduler, loss scale, counters and client_state, at any world size
        and stage. DeepSpeed's files are pickles, read without running code; `trust_pickles`
        (or SHARDWISE_TRUST_PICKLES=1) reads one that holds other types, for a trusted file."""
        opened = _open_deepspeed(self, load_dir, tag, optimizer_states=optimizer_states and not module_only,
                                 trusted=trust_pickles)
        return super().load_checkpoint(load_dir, tag, optimizer_states=optimizer_states, module_only=module_only,
                                       strict=strict, opened=opened)

    def save_deepspeed_checkpoint(self, save_dir: str | os.PathLike, tag: str | None = None,
                                  client_state: dict | None = None, *, zero_stage: int | None = None,
                                  sub_group_size: int = SUB_GROUP_SIZE) -> Path:
        """Save a checkpoint in DeepSpeed's layout under `save_dir/tag` (with `latest`), for a
        DeepSpeed run of this data-parallel size to resume: the way back to DeepSpeed
        (frontends/deepspeed/checkpoints/to_deepspeed.py says what it writes and refuses).
        `zero_stage`: the DeepSpeed run's (default: this engine's; 2 for an engine without
        ZeRO; a pipeline is written for ZeRO-1 with its own stage split); `sub_group_size`:
        the DeepSpeed run's at ZeRO-3. Collective. shardwise's own checkpoint is written
        first, into a hidden folder under `save_dir` that is removed once rank 0 has
        converted it."""
        parts = None
        if self.pipeline is not None:
            layout = self.pipeline.layout
            if layout.virtual != 1:
                raise ValueError("save_deepspeed_checkpoint: DeepSpeed's pipeline runs one chunk per stage; this "
                                 f"engine runs {layout.virtual} (interleaved schedule)")
            parts = [run[0] for run in layout.runs] + [layout.runs[-1][-1] + 1]
            zero_stage = 1 if zero_stage is None else zero_stage
        elif zero_stage is None:
            zero_stage = self.stage if self.stage in (1, 2, 3) else 2
        staging = Path(save_dir) / ".shardwise-for-deepspeed"
        written_tag = Engine.save_checkpoint(self, staging, tag, client_state, asynchronous=False)  # converted next
        failure = None
        if self.rank == 0:
            try:
                write_deepspeed_checkpoint(staging, save_dir, world_size=self.mesh["data"].size, stage=zero_stage,
                                           tag=written_tag, pipeline_parts=parts, sub_group_size=sub_group_size)
            except (CheckpointError, ValueError) as error:
                failure = str(error)
            shutil.rmtree(staging, ignore_errors=True)
        failure = self.world.control_all_gather_object(failure)[0]  # every rank raises rank 0's refusal
        if failure is not None:
            raise CheckpointError(failure)
        return Path(save_dir) / written_tag

    def save_16bit_model(self, save_dir: str | os.PathLike, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Rank 0 writes the whole model's state_dict (in the training dtype: 16-bit with
        fp16/bf16, else fp32) to `save_dir/save_filename` with `torch.save`. Collective: a
        bad folder or file name on any rank is one EngineArgumentError on every rank.

        At stage 3 the weights are gathered one module at a time, and only when
        `zero_optimization.stage3_gather_16bit_weights_on_model_save` is true, as in
        DeepSpeed: otherwise nothing is written and False is returned (use
        save_checkpoint and `shardwise convert` instead)."""
        raise_on_every_rank(self.world, "save_16bit_model", folder_problem("save_16bit_model", save_dir),
                            name_problem("save_16bit_model", "save_filename", save_filename))
        zero = self.policies.zero
        if zero.partitions_parameters and not zero.gather_16bit_weights_on_save:
            log.warning("save_16bit_model: nothing saved: at ZeRO stage 3 it needs "
                        "zero_optimization.stage3_gather_16bit_weights_on_model_save: true")
            return False
        state = self._gathered_state_dict(exclude_frozen_parameters)
        if state is not None:
            Path(save_dir).mkdir(parents=True, exist_ok=True)
            torch.save(state, Path(save_dir) / save_filename)
        self.world.barrier("save_16bit_model")  # the file exists on return, on every rank
        return True

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict | None:
        """DeepSpeed's: the whole model's state_dict on rank 0 (None on the others),
        gathered one module at a time from the ZeRO-3 shards, in the training dtype, on the
        CPU; a tied weight is one tensor under each of its names. Accelerate's
        `get_state_dict` and the Hugging Face Trainer's `save_model` call it at stage 3.
        Collective; only at stage 3, as in DeepSpeed."""
        if not self.policies.zero.partitions_parameters:
            raise ValueError("this function requires ZeRO-3 mode")
        return self._gathered_state_dict(exclude_frozen_parameters)

    def _consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict | None:
        """DeepSpeed's name for the same where weights are partitioned (ZeRO-3; DeepSpeed's
        AutoTP, which shardwise accepts only switched off, is the other case)."""
        if not self.policies.zero.partitions_parameters:
            raise ValueError("consolidated_16bit_state_dict is only applicable to cases where weights are "
                             "partitioned, including Zero Stage 3 and tensor parallelism.")
        return self._gathered_state_dict(exclude_frozen_parameters)

    def module_state_dict(self, destination: dict | None = None, prefix: str = "", keep_vars: bool = False,
                          exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor]:
        """DeepSpeed's: the model's own `state_dict` (at ZeRO-3 each parameter is this rank's
        empty placeholder, as in DeepSpeed: `_zero3_consolidated_16bit_state_dict()` gathers
        the weights), without the frozen parameters when asked."""
        state = self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if exclude_frozen_parameters:
            for name, param in self.module.named_parameters():
                if not param.requires_grad:
                    state.pop(prefix + name, None)
        return state

    def _gathered_state_dict(self, exclude_frozen_parameters: bool) -> dict[str, torch.Tensor] | None:
        """The whole model's persistent state on rank 0 (None on the others), copied to the
        CPU one module at a time, each module's ZeRO-3 shards gathered only while it is
        copied. Collective."""
        frozen = {id(param) for param in self.module.parameters() if not param.requires_grad}
        state: dict[str, torch.Tensor] = {}
        copies: dict[int, torch.Tensor] = {}  # a tied parameter's one copy, by the parameter
        for prefix, submodule in self.module.named_modules():
            params = [param for param in submodule.parameters(recurse=False)]
            with gathered_parameters(params):
                if self.rank != 0:
                    continue
                for name, param in submodule.named_parameters(recurse=False):
                    if not (exclude_frozen_parameters and id(param) in frozen):
                        if id(param) not in copies:
                            copies[id(param)] = param.detach().to("cpu", copy=True)
                        state[_join(prefix, name)] = copies[id(param)]
                for name, buffer in submodule.named_buffers(recurse=False):
                    if name not in submodule._non_persistent_buffers_set:
                        state[_join(prefix, name)] = buffer.detach().to("cpu", copy=True)
        return state if self.rank == 0 else None


def _open_deepspeed(engine: Engine, load_dir: str | os.PathLike, tag: str | None, *, optimizer_states: bool,
                    trusted: bool) -> OpenedCheckpoint | None:
    """The DeepSpeed checkpoint at `load_dir` (`tag`, or the one `latest` names) opened for
    the engine; None when it is shardwise's own."""
    directory = deepspeed_checkpoint_dir(load_dir, tag)
    if directory is None:
        return None
    return open_deepspeed_checkpoint(engine, directory, optimizer_states=optimizer_states, trusted=trusted)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
