"""The engine `shardwise.initialize` returns for a DeepSpeed config: the runtime's engine,
plus the config it was built from and the accessors DeepSpeed's engine offers (C26).

Scripts written for DeepSpeed ask their engine what it was configured with
(`engine.fp16_enabled()`, `engine.train_micro_batch_size_per_gpu()`, `engine.local_rank`...)
and save a consolidated 16-bit model with `engine.save_16bit_model(dir)`. These read the
resolved config and the engine's state, so they answer the same on an engine built by
`shardwise.initialize` and on one built by DeepSpeed's `initialize` (api/engine.py, whose
subclass also gives the names whose DeepSpeed shape differs from shardwise's:
`gradient_accumulation_steps()` as a method, `load_checkpoint` returning a tuple).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from shardwise.frontends.deepspeed.call_arguments import folder_problem, name_problem, raise_on_every_rank
from shardwise.frontends.deepspeed.config import ShardwiseConfig
from shardwise.runtime.engine import Engine, Job, Policies
from shardwise.runtime.zero.gathered import gathered_parameters

log = logging.getLogger("shardwise")


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

    @property
    def global_rank(self) -> int:
        """This process's rank in the whole job (DeepSpeed's name for `engine.rank`)."""
        return self.rank

    @property
    def local_rank(self) -> int:
        """This process's rank on its node (LOCAL_RANK), which picks its device."""
        return self.context.local_rank

    def fp16_enabled(self) -> bool:
        return self.config.fp16.enabled

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale

    def bfloat16_enabled(self) -> bool:
        return self.config.bf16.enabled

    def train_batch_size(self) -> int:
        """Samples per optimizer step over all data-parallel ranks."""
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def steps_per_print(self) -> int:
        return self.config.steps_per_print

    def zero_optimization_stage(self) -> int:
        return self.stage

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    def get_global_grad_norm(self) -> float | None:
        """Norm of the whole (unscaled, unclipped) gradient at the last update; None
        before the first one."""
        return self.last_grad_norm

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
        frozen = {id(param) for param in self.module.parameters() if not param.requires_grad}
        state: dict[str, torch.Tensor] = {}
        for prefix, submodule in self.module.named_modules():
            params = [param for param in submodule.parameters(recurse=False)]
            with gathered_parameters(params):
                if self.rank != 0:
                    continue
                for name, param in submodule.named_parameters(recurse=False):
                    if not (exclude_frozen_parameters and id(param) in frozen):
                        state[_join(prefix, name)] = param.detach().to("cpu", copy=True)
                for name, buffer in submodule.named_buffers(recurse=False):
                    if name not in submodule._non_persistent_buffers_set:
                        state[_join(prefix, name)] = buffer.detach().to("cpu", copy=True)
        if self.rank == 0:
            Path(save_dir).mkdir(parents=True, exist_ok=True)
            torch.save(state, Path(save_dir) / save_filename)
        self.world.barrier("save_16bit_model")  # the file exists on return, on every rank
        return True


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
