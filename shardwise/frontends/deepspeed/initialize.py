"""`shardwise.initialize(model, config)`: a DeepSpeed config in, an engine out.

    engine = shardwise.initialize(model, "ds_config.json", optimizer=torch.optim.AdamW(model.parameters()))

The config is loaded for this job (its world size fills the batch sizes, the model's width
fills "auto" buckets), turned into the runtime's policies (config/policies.py), and the
engine is built from them as in Python (`shardwise.build_engine`). DeepSpeed's
activation-checkpointing API (`deepspeed.checkpointing`), for model code that checkpoints
its own layers, is configured from the config's `activation_checkpointing` block, when it
has one, unless the script configured it.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Callable, Mapping

import torch
from torch import nn

from shardwise.frontends.deepspeed import checkpointing as deepspeed_checkpointing
from shardwise.frontends.deepspeed.config import ActivationCheckpointingConfig, ShardwiseConfig, load_config
from shardwise.frontends.deepspeed.config.policies import policies_from_config
from shardwise.frontends.deepspeed.engine import ConfiguredEngine
from shardwise.frontends.python import build_engine
from shardwise.runtime.activation import CheckpointStore, RegionStats
from shardwise.runtime.distributed.collectives import mesh_communicator
from shardwise.runtime.distributed.setup import init_distributed
from shardwise.runtime.engine.arguments import hidden_size


def initialize(
    model: nn.Module,
    config: dict | str | os.PathLike | ShardwiseConfig,
    optimizer: torch.optim.Optimizer | None = None,
    lr_scheduler: Any = None,
    param_init_fn: Callable[[nn.Module], None] | None = None,
    *,
    auto_values: Mapping[str, Any] | None = None,
    engine_class: type[ConfiguredEngine] = ConfiguredEngine,
    sequence_sharded_by_caller: bool = False,
    count_saved_activations: bool = True,
) -> ConfiguredEngine:
    """Wrap `model` for (ZeRO) data-parallel training by a DeepSpeed config (a dict, a JSON
    path, or a resolved config); see docs/getting-started.md.

    `param_init_fn(module)` initialises a module built on the meta device (stage 3 only;
    default: `module.reset_parameters()`). `auto_values` fills the config's "auto" entries
    by dotted key (e.g. {"optimizer.params.lr": 3e-4, "train_micro_batch_size_per_gpu": 8}),
    as Hugging Face's trainer does from its arguments.

    Without an optimizer (none passed, no `optimizer` block) the engine runs forward only
    (a reference model, evaluation): parameters held as ZeRO holds trained ones, nothing else.
    `sequence_sharded_by_caller`: the script runs Ulysses itself (`SequencePolicy`).
    `count_saved_activations`: `ActivationPolicy.count_saved` (the config's
    `activation_checkpointing.profile` turns it on whatever this says).
    """
    context = init_distributed()
    cfg = config if isinstance(config, ShardwiseConfig) else load_config(
        config, world_size=context.world_size, hidden_size=hidden_size(model), auto_values=auto_values
    )
    if cfg.seed is not None:
        torch.manual_seed(cfg.seed)
    policies = policies_from_config(cfg, sequence_sharded_by_caller=sequence_sharded_by_caller)
    if not count_saved_activations and not policies.activation.profile:
        policies = dataclasses.replace(policies, activation=dataclasses.replace(policies.activation,
                                                                                count_saved=False))
    engine = build_engine(model, policies, optimizer=optimizer, lr_scheduler=lr_scheduler,
                          param_init_fn=param_init_fn, tensor_styles=cfg.tensor_parallel.plan, context=context,
                          settings=cfg.model_dump(), engine_class=functools.partial(engine_class, config=cfg))
    if cfg.activation_checkpointing != ActivationCheckpointingConfig() and not deepspeed_checkpointing.is_configured():
        tensor = mesh_communicator(engine.mesh, "tensor")
        store = CheckpointStore.for_policy(policies.activation, tensor)
        stats = RegionStats() if policies.activation.profile else None
        deepspeed_checkpointing.configure_store(store, cfg.activation_checkpointing, stats)
    return engine
