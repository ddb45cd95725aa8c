"""The training engine: forward, backward and step, read top to bottom.

    engine = shardwise.initialize(model, config)
    loss = engine(batch)        # the user's forward
    engine.backward(loss)       # gradients reduced/sharded while backward runs
    engine.step()               # at accumulation boundaries: unscale, clip, update, gather

Everything stage-specific is delegated to small parts built once in `__init__`:
`ReplicatedParameters` (stages 0-2 keep all weights) or `Stage3Parameters` (1/N of each,
gathered by module hooks), `GradientReducer` (all-reduce or reduce-scatter during
backward), `ShardedOptimizer` (the update on the owned 1/N).
"""

from __future__ import annotations

import math
import os
import weakref
from typing import Any, Callable

import torch
from torch import nn

from shardwise.accounting import MemoryLedger, tensor_bytes
from shardwise.config import ShardwiseConfig, load_config
from shardwise.distributed.collectives import Communicator
from shardwise.distributed.setup import init_distributed
from shardwise.optim import build_optimizer, build_scheduler
from shardwise.precision import LossScaler
from shardwise.zero.gradients import GradientReducer
from shardwise.zero.layout import align_elements, pack_units
from shardwise.zero.replicated_params import ReplicatedParameters
from shardwise.zero.sharded_optimizer import ShardedOptimizer
from shardwise.zero.stage3 import Stage3Parameters
from shardwise.zero.trainable import trainable_parameters

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Engine:
    def __init__(
        self,
        model: nn.Module,
        config: dict | str | os.PathLike | ShardwiseConfig,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler: Any = None,
        param_init_fn: Callable[[nn.Module], None] | None = None,
    ):
        self.context = init_distributed()
        self.config = config if isinstance(config, ShardwiseConfig) else load_config(
            config, world_size=self.context.world_size, hidden_size=_hidden_size(model)
        )
        cfg, zero = self.config, self.config.zero_optimization
        if optimizer is not None and cfg.optimizer is not None:
            raise ValueError(
                "an optimizer was passed to initialize() and the config has an 'optimizer' "
                "block; keep one of them"
            )
        if optimizer is None and cfg.optimizer is None:
            raise ValueError("no optimizer: pass one to initialize() or add an 'optimizer' block")
        if lr_scheduler is not None and cfg.scheduler is not None:
            raise ValueError(
                "an lr_scheduler was passed to initialize() and the config has a 'scheduler' "
                "block; keep one of them"
            )
        if cfg.seed is not None:
            torch.manual_seed(cfg.seed)

        self.module = model
        self.device = self.context.device
        self.stage = zero.stage
        self.dtype = _compute_dtype(cfg)
        self.ledger = MemoryLedger()
        self.comm = Communicator(self.context, self.ledger)
        self.world_size = self.context.world_size
        self.rank = self.context.rank
        self.gradient_accumulation_steps = cfg.gradient_accumulation_steps
        self.micro_steps = 0
        self.global_steps = 0
        self.skipped_steps = 0
        self.last_grad_norm: float | None = None

        on_meta = any(param.is_meta for param in model.parameters())
        if on_meta and self.stage != 3:
            raise ValueError(
                "the model has parameters on the meta device; only ZeRO stage 3 can build "
                "it partitioned (set zero_optimization.stage to 3)"
            )
        if not on_meta:
            model.to(self.device)
        named = trainable_parameters(model, optimizer)
        align = align_elements(self.dtype)
        owned_chunk = 0 if self.stage == 0 else self.rank  # stage 0: every rank owns all
        if self.stage == 3:
            self.params = Stage3Parameters(
                model, named, self.dtype, self.device, self.comm, self.ledger, zero, align,
                param_init_fn,
            )
        else:
            num_chunks = 1 if self.stage == 0 else self.world_size
            units = pack_units(reversed(named), zero.reduce_bucket_size, num_chunks, align)
            self.params = ReplicatedParameters(
                units, self.dtype, self.device, self.comm, self.ledger, owned_chunk,
                zero.allgather_bucket_size,
            )
            self.params.broadcast_from_rank0()
        self.units = self.params.units
        self._cast_frozen_state(model)
        comm_dtype = DTYPES[cfg.communication_data_type] if cfg.communication_data_type else self.dtype
        self.reducer = GradientReducer(
            self.units, self.stage, self.comm, self.ledger, self.dtype, comm_dtype, self.device,
            overlap=zero.overlap_comm, reduce_scatter=zero.reduce_scatter,
        )
        if self.stage == 3:
            self.reducer.unit_ready_callbacks.append(self.params.schedule.on_grads_ready)
            self.params.schedule.backward_use_callbacks.append(self.reducer.prepare_unit)
        self.optimizer = ShardedOptimizer(
            self.units,
            owned_chunk,
            [self.params.owned_chunk(unit) for unit in self.units],
            [self.reducer.owned_grad(unit) for unit in self.units],
            self.ledger,
            zero.sub_group_size,
            make_optimizer=_optimizer_factory(optimizer, cfg),
        )
        self.unit_of_param = {id(slot.param): unit for unit in self.units for slot in unit.slots}
        for unit in self.units:
            for slot in unit.slots:
                slot.param._shardwise_engine = weakref.ref(self)
        self.lr_scheduler = _make_scheduler(lr_scheduler, cfg, self.optimizer.optimizer)
        self.loss_scaler = _make_loss_scaler(cfg)
        self.comm.reset_comm_volume()

    # -- the training step ---------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The user's forward; floating-point inputs are cast to the compute dtype."""
        args, kwargs = _cast_floating((args, kwargs), self.dtype)
        return self.module(*args, **kwargs)

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.gradient_accumulation_steps == 0

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of `loss` averaged over accumulation steps and scaled for fp16."""
        scale = self.loss_scaler.scale / self.gradient_accumulation_steps
        self.reducer.begin_backward(reduce=self.is_gradient_accumulation_boundary())
        (loss.float() * scale).backward()
        self.reducer.end_backward()
        if self.stage == 3:
            self.params.schedule.end_backward()

    def step(self) -> None:
        """Apply the update at an accumulation boundary; otherwise only count the micro-step."""
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        if not boundary:
            return
        norm_squared = self.optimizer.local_grad_norm_squared()
        if self.stage > 0:
            self.comm.control_all_reduce(norm_squared, "global gradient norm")
        scale = self.loss_scaler.scale
        total_norm = math.sqrt(norm_squared.item()) / scale
        overflow = not math.isfinite(total_norm)
        self.last_grad_norm = total_norm
        self.loss_scaler.update(overflow)
        if overflow and self.dtype == torch.float16:
            self.skipped_steps += 1
        else:
            clip = 1.0
            max_norm = self.config.gradient_clipping
            if max_norm > 0:
                clip = min(1.0, max_norm / (total_norm + 1e-6))
            self.optimizer.step(grad_scale=clip / scale)
            self.params.after_step()
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        self.reducer.zero_grads()
        self.global_steps += 1

    # -- checkpoints (shardwise/checkpoint) ----------------------------------------------
    def save_checkpoint(self, save_dir: str | os.PathLike, tag: str | None = None,
                        client_state: dict | None = None) -> str:
        """Write this rank's shard of everything needed to resume; returns the tag."""
        from shardwise.checkpoint import save_checkpoint

        return save_checkpoint(self, save_dir, tag, client_state)

    def load_checkpoint(self, load_dir: str | os.PathLike, tag: str | None = None) -> dict:
        """Resume from a checkpoint (any world size or stage); returns its client_state."""
        from shardwise.checkpoint import load_checkpoint

        return load_checkpoint(self, load_dir, tag)

    # -- accounting ----------------------------------------------------------------------
    def memory_breakdown(self) -> dict[str, int]:
        """Bytes this rank held per category at that category's peak (SPEC §4)."""
        return self.ledger.breakdown()

    def comm_volume(self) -> dict[str, int]:
        """Bytes this rank sent per collective since the last reset (ring model, SPEC §4)."""
        return self.comm.comm_volume()

    def reset_comm_volume(self) -> None:
        self.comm.reset_comm_volume()

    def num_parameters(self) -> int:
        return sum(unit.numel for unit in self.units)

    def persistent_numel(self) -> int:
        """Stage 3: elements kept whole on every rank (under the persistence threshold)."""
        return self.params.persistent_numel() if self.stage == 3 else 0

    def padding_elements(self) -> int:
        return sum(unit.padded_numel - unit.numel for unit in self.units)

    # -- conveniences DeepSpeed users expect ---------------------------------------------
    def train(self, mode: bool = True) -> "Engine":
        self.module.train(mode)
        return self

    def eval(self) -> "Engine":
        return self.train(False)

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.optimizer.param_groups]

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale

    def _cast_frozen_state(self, model: nn.Module) -> None:
        """Frozen parameters and floating-point buffers (e.g. BatchNorm statistics) take
        the compute dtype, as DeepSpeed casts the whole module; frozen parameters are
        held whole on every rank and counted as parameters."""
        for param in model.parameters():
            if not param.requires_grad and param.is_floating_point():
                param.data = param.data.to(self.dtype)
                self.ledger.hold("params", tensor_bytes(param))
        for module in model.modules():
            for name, buffer in module.named_buffers(recurse=False):
                if buffer.is_floating_point():
                    module._buffers[name] = buffer.to(self.dtype)

    def destroy(self) -> None:
        self.reducer.remove_hooks()
        if self.stage == 3:
            self.params.schedule.remove_hooks()


def initialize(
    model: nn.Module,
    config: dict | str | os.PathLike,
    optimizer: torch.optim.Optimizer | None = None,
    lr_scheduler: Any = None,
    param_init_fn: Callable[[nn.Module], None] | None = None,
) -> Engine:
    """Wrap `model` for (ZeRO) data-parallel training; see SPEC §2.

    `param_init_fn(module)` initialises a module built on the meta device (stage 3 only;
    default: `module.reset_parameters()`).
    """
    return Engine(model, config, optimizer, lr_scheduler, param_init_fn)


def _compute_dtype(cfg: ShardwiseConfig) -> torch.dtype:
    if cfg.bf16.enabled:
        return torch.bfloat16
    if cfg.fp16.enabled:
        return torch.float16
    return torch.float32


def _hidden_size(model: nn.Module) -> int | None:
    config = getattr(model, "config", None)
    return getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)


def _optimizer_factory(
    optimizer: torch.optim.Optimizer | None, cfg: ShardwiseConfig
) -> Callable[[list[list[torch.Tensor]]], torch.optim.Optimizer]:
    """How to get a torch optimizer over the owned segments, one list per param group."""

    def repoint(groups: list[list[torch.Tensor]]) -> torch.optim.Optimizer:
        for group, params in zip(optimizer.param_groups, groups):
            group["params"] = params
        optimizer.state.clear()
        return optimizer

    def from_config(groups: list[list[torch.Tensor]]) -> torch.optim.Optimizer:
        return build_optimizer([{"params": params} for params in groups], cfg.optimizer)

    return repoint if optimizer is not None else from_config


def _make_scheduler(lr_scheduler: Any, cfg: ShardwiseConfig, optimizer: torch.optim.Optimizer) -> Any:
    if cfg.scheduler is not None:
        return build_scheduler(optimizer, cfg.scheduler)
    if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
        return lr_scheduler(optimizer)
    return lr_scheduler


def _make_loss_scaler(cfg: ShardwiseConfig) -> LossScaler:
    fp16 = cfg.fp16
    if not fp16.enabled:
        return LossScaler(1.0)
    if fp16.loss_scale > 0:
        return LossScaler(fp16.loss_scale)
    return LossScaler(
        2.0**fp16.initial_scale_power,
        dynamic=True,
        scale_window=fp16.loss_scale_window,
        hysteresis=fp16.hysteresis,
        consecutive_hysteresis=fp16.consecutive_hysteresis,
        min_scale=fp16.min_loss_scale,
    )


def _cast_floating(value: Any, dtype: torch.dtype) -> Any:
    if dtype == torch.float32:
        return value
    if torch.is_tensor(value):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(_cast_floating(item, dtype) for item in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_cast_floating(item, dtype) for item in value)
    if isinstance(value, dict):
        return {key: _cast_floating(item, dtype) for key, item in value.items()}
    return value
