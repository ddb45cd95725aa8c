"""`deepspeed.initialize`: DeepSpeed's entry point, resolved into shardwise's engine.

What DeepSpeed does with each argument, and what this does:
- the config comes from `config` (or its old name `config_params`), else from
  `args.deepspeed_config` (or the deprecated `args.deepscale_config`); both at once is
  an error, as in DeepSpeed;
- an `optimizer` passed in (an instance, or a callable taking the parameters) wins over
  the config's `optimizer` block, and an `lr_scheduler` over its `scheduler` block; the
  block is dropped with a warning (shardwise.initialize would refuse the pair);
- `model_parameters` (parameters, or param-group dicts with their own hyper-parameters)
  are what the config's optimizer trains, in those groups;
- `training_data` becomes a loader of micro-batches, each rank reading its own share
  of every epoch (DeepSpeed's DistributedSampler: shuffled with seed 0, the same order
  every epoch unless the script calls `loader.sampler.set_epoch`), through `collate_fn`;
  the engine's checkpoints hold its position (frontends/deepspeed/data_loader.py);
- `args.local_rank` is set to this process's LOCAL_RANK;
- `mpu`: only the one `UlyssesSPAttentionHF.register_with_transformers` returns (ALST's
  Ulysses, run by the script: api/runtime/sequence_parallel/); the config's
  `sequence_parallel_size` must be its size, the engine's `sequence` and data x sequence
  groups must hold its groups' ranks, and the engine leaves the model to the script
  (`SequencePolicy.sharded_by_caller`), only averaging gradients over data x sequence
  ranks. Any other mpu is refused: shardwise builds its groups from the config;
- `sequence_parallel_size` > 1 without an mpu: a model shardwise knows (models/) gets
  shardwise's own Ulysses, unless it holds a `deepspeed.sequence.layer.
  DistributedAttention`; any other model is left to the script, as DeepSpeed leaves every
  model (Megatron-DeepSpeed's Ulysses: it feeds each rank its shard of the positions and
  wraps its attention in `DistributedAttention` over `groups._get_sequence_parallel_group()`),
  and the engine averages gradients over data x sequence ranks. A `DistributedAttention`
  in the model must exchange over the layout's sequence group (same ranks);
- `deepspeed.utils.groups` answers from the engine's layout from then on (its sequence
  groups: the mpu's own process groups, which the script's adapter and attention use).
It returns (engine, optimizer, training_dataloader, lr_scheduler): the optimizer is the
torch optimizer that steps this rank's fp32 partition (the one passed in, re-pointed).
With no optimizer (none passed, no `optimizer` block), the engine runs forward only, as
DeepSpeed-Chat's and OpenRLHF's reference and reward models use it, and the optimizer
returned is None (zero/trainable.py: `evaluated_parameters`).
"""

from __future__ import annotations

import copy
import logging
import os
from types import ModuleType
from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from shardwise.frontends.deepspeed.api.runtime.engine.checkpoint_arguments import tag_validation_mode
from shardwise.frontends.deepspeed.api.comm import DEFAULT_PORT, configure as configure_comms_logger, init_distributed
from shardwise.frontends.deepspeed.api.runtime.engine import DeepSpeedEngine
from shardwise.frontends.deepspeed.api.runtime.pipe.engine import PipelineEngine
from shardwise.frontends.deepspeed.api.pipe import PipelineModule
from shardwise.frontends.deepspeed.api.ops.adam import FusedAdam
from shardwise.frontends.deepspeed.api.runtime.base_optimizer import DeepSpeedOptimizer, ZeROOptimizer, mark_wrapped
from shardwise.frontends.deepspeed.api.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
from shardwise.frontends.deepspeed.api.autotp import check_recorded_size
from shardwise.frontends.deepspeed.api.runtime.bf16_optimizer import BF16_Optimizer
from shardwise.frontends.deepspeed.api.runtime.config import (DEEPSPEED_GRADIENT_CLIPPING, TORCH_ADAM_PARAM,
                                                                DeepSpeedConfigError)
from shardwise.frontends.deepspeed.api.runtime.fp16.fused_optimizer import FP16_Optimizer
from shardwise.frontends.deepspeed.api.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
from shardwise.frontends.deepspeed.api.runtime.sequence_parallel import parallel_state_sp
from shardwise.frontends.deepspeed.api.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from shardwise.frontends.deepspeed.api.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from shardwise.frontends.deepspeed.api.sequence.layer import DistributedAttention
from shardwise.frontends.deepspeed.api.utils import groups as parallel_groups
from shardwise.frontends.deepspeed.config import load_config, read_config
from shardwise.frontends.deepspeed.initialize import initialize as initialize_engine
from shardwise.models.families import plan_for
from shardwise.runtime.engine.arguments import hidden_size
from shardwise.runtime.optim.registry import optimizer_spec

log = logging.getLogger("shardwise")


def initialize(
    args: Any = None,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | Callable[..., torch.optim.Optimizer] | None = None,
    model_parameters: Iterable[Any] | None = None,
    training_data: Dataset | None = None,
    lr_scheduler: Any = None,
    distributed_port: int = DEFAULT_PORT,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Callable | None = None,
    config: dict | str | os.PathLike | None = None,
    mesh_param: Any = None,
    config_params: dict | str | os.PathLike | None = None,
) -> tuple[DeepSpeedEngine, torch.optim.Optimizer, DataLoader | None, Any]:
    """DeepSpeed's `initialize` (see the module docstring for each argument)."""
    if model is None:
        raise ValueError("deepspeed.initialize requires a model")
    if mpu is not None and mpu is not parallel_state_sp:
        raise ValueError("deepspeed.initialize(mpu=...) is not supported: shardwise builds its model-parallel groups "
                         "from the config's tensor_parallel, sequence_parallel and pipeline_parallel blocks (the one "
                         "mpu taken is the one UlyssesSPAttentionHF.register_with_transformers returns; for "
                         "Megatron-DeepSpeed's Ulysses set sequence_parallel_size and take the group from "
                         "deepspeed.utils.groups._get_sequence_parallel_group() after initialize)")
    raw = read_config(_choose_config(args, config if config is not None else config_params))
    script_config = copy.deepcopy(raw)  # as written: DeepSpeed's accessors answer from it
    client_optimizer = optimizer
    raw.setdefault("gradient_clipping", DEEPSPEED_GRADIENT_CLIPPING)
    if mpu is not None:
        _sequence_size_from_mpu(raw, mpu.get_sequence_parallel_world_size())
    if mesh_param is not None:
        _sequence_size_from_mesh(raw, mesh_param)
    try:
        tag_validation = tag_validation_mode(raw)
    except ValueError as error:
        raise DeepSpeedConfigError(str(error)) from None
    init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required)
    if mesh_param is not None:
        _require_mesh_covers_world(mesh_param, torch.distributed.get_world_size())
    _align_local_rank(args)
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer(list(model_parameters if model_parameters is not None else model.parameters()))
    _drop_overridden(raw, "optimizer", optimizer)
    _drop_overridden(raw, "scheduler", lr_scheduler)
    _pipeline_block(raw, model)
    auto_values = {"scheduler.params.warmup_max_lr": optimizer.defaults["lr"]} if optimizer is not None else {}
    world_size = torch.distributed.get_world_size()
    cfg = load_config(raw, world_size=world_size, hidden_size=hidden_size(model), auto_values=auto_values)
    if raw.get("comms_logger"):  # DeepSpeed's engine configures deepspeed.comm's logger from its block
        configure_comms_logger(raw)
    if mpu is not None:
        _require_mpu_size(cfg.sequence_parallel.size, mpu.get_sequence_parallel_world_size())
    check_recorded_size(model, cfg.tensor_parallel.size)
    cfg.remember_written(script_config)  # engine.config read as a dict, as DeepSpeed's is
    if optimizer is None and cfg.optimizer is not None and model_parameters is not None:
        groups = _param_groups(model, model_parameters)
        if not _all_trainable_in_one_group(model, groups):  # else the engine builds the same from the config
            optimizer = optimizer_spec(cfg.optimizer.type).build(groups, dict(cfg.optimizer.params))
            cfg = cfg.model_copy(update={"optimizer": None})
    engine_class = PipelineEngine if isinstance(model, PipelineModule) else DeepSpeedEngine  # as DeepSpeed's
    attentions = _distributed_attentions(model)
    engine = initialize_engine(model, cfg, optimizer, lr_scheduler, engine_class=engine_class,
                               sequence_sharded_by_caller=_script_splits_sequence(model, cfg.sequence_parallel.size,
                                                                                  mpu, attentions),
                               # code written for DeepSpeed reads ZeRO-3's attributes of saved parameters in backward
                               count_saved_activations=cfg.zero_optimization.stage != 3)
    engine.tag_validation = tag_validation
    engine.script_config, engine.client_optimizer, engine.client_lr_scheduler = (script_config, client_optimizer,
                                                                                 lr_scheduler)
    if mpu is not None:
        _require_same_sequence_groups(engine, mpu)
    _require_attention_over_sequence_group(engine, attentions)
    parallel_groups.use_mesh(engine.mesh, sequence_groups=mpu)  # deepspeed.utils.groups answers from this layout
    engine.collate_fn = collate_fn  # deepspeed_io's default, as in DeepSpeed
    if training_data is not None:
        engine.training_dataloader = engine.deepspeed_io(training_data)
        engine.attach_data_position(engine.training_dataloader)  # the checkpoints hold where it is
        if engine.zenflow is not None:  # an epoch-based column selection counts its batches
            engine.zenflow.learn_epoch_length(len(engine.training_dataloader))
    return (engine, _clearing_model_gradients(engine, _deepspeed_wrapper(engine, raw)), engine.training_dataloader,
            engine.lr_scheduler)


def _distributed_attentions(model: nn.Module) -> dict[str, DistributedAttention]:
    return {name: module for name, module in model.named_modules() if isinstance(module, DistributedAttention)}


def _script_splits_sequence(model: nn.Module, size: int, mpu: Any, attentions: dict[str, DistributedAttention]
                            ) -> bool:
    """Whether the script, not shardwise, splits the sequence (module docstring): with
    ALST's mpu, with DistributedAttention in the model, or for a model shardwise has no
    Ulysses plan for."""
    if size == 1:
        return False
    if mpu is not None or attentions:
        return True
    if plan_for(model).ulysses is None:
        log.info("deepspeed.initialize: sequence_parallel_size %d and a %s, whose attention shardwise does not "
                 "split: the script feeds each rank its positions and exchanges them in its attention "
                 "(deepspeed.sequence.layer.DistributedAttention over groups._get_sequence_parallel_group())",
                 size, type(model).__name__)
        return True
    return False


def _require_attention_over_sequence_group(engine: DeepSpeedEngine, attentions: dict[str, DistributedAttention]
                                           ) -> None:
    """The engine averages gradients over its layout's sequence group: a DistributedAttention
    exchanging over other ranks would train on a sequence the engine does not know of."""
    wanted = list(engine.mesh["sequence"].ranks)
    for name, attention in attentions.items():
        group = attention.spg if attention.spg is not None else torch.distributed.group.WORLD
        ranks = torch.distributed.get_process_group_ranks(group)
        if ranks != wanted:
            raise ValueError(
                f"{name} (DistributedAttention) exchanges over ranks {ranks} but the config's sequence-parallel "
                f"group of this rank is ranks {wanted} (sequence_parallel_size {len(wanted)}): set "
                f"sequence_parallel_size to {len(ranks)}, or build the attention over "
                "deepspeed.utils.groups._get_sequence_parallel_group() after deepspeed.initialize")


def _sequence_size_from_mpu(raw: dict, mpu_size: int) -> None:
    """A config without a sequence-parallel size takes the mpu's, as DeepSpeed counts the
    data-parallel ranks from the mpu (Accelerate's `sp_backend="deepspeed"` writes none)."""
    if "sequence_parallel_size" not in raw and "sequence_parallel" not in raw:
        raw["sequence_parallel_size"] = mpu_size


def _sequence_size_from_mesh(raw: dict, mesh_param: Any) -> None:
    """`mesh_param=(data_parallel_size, sequence_parallel_size)`, DeepSpeed's (data, sequence)
    device mesh, sequence innermost: shardwise's layout with that sequence-parallel size
    puts the same consecutive ranks in each sequence group."""
    if not (isinstance(mesh_param, (tuple, list)) and len(mesh_param) == 2
            and all(isinstance(size, int) and size >= 1 for size in mesh_param)):
        raise ValueError(f"deepspeed.initialize(mesh_param={mesh_param!r}): give (data_parallel_size, "
                         "sequence_parallel_size), two positive integers")
    configured = raw.get("sequence_parallel_size", mesh_param[1])
    if configured != mesh_param[1]:
        raise DeepSpeedConfigError(f"the config's sequence_parallel_size is {configured} but mesh_param gives "
                                   f"{mesh_param[1]}: make them the same, or drop one")
    raw["sequence_parallel_size"] = mesh_param[1]


def _require_mesh_covers_world(mesh_param: tuple[int, int], world_size: int) -> None:
    if mesh_param[0] * mesh_param[1] != world_size:
        raise ValueError(f"deepspeed.initialize(mesh_param={tuple(mesh_param)}): {mesh_param[0]} x {mesh_param[1]} "
                         f"ranks, but the world has {world_size}: the data- and sequence-parallel sizes must "
                         "multiply to the world size")


def _require_mpu_size(configured: int, mpu_size: int) -> None:
    if configured != mpu_size:
        raise DeepSpeedConfigError(
            f"the config's sequence_parallel_size is {configured} but the mpu from "
            f"UlyssesSPAttentionHF.register_with_transformers has sequence_parallel_size {mpu_size}: set the "
            "config's sequence_parallel_size to the size given to register_with_transformers (the batch sizes and "
            "the gradient averaging count its ranks)")


def _require_same_sequence_groups(engine: DeepSpeedEngine, mpu: ModuleType) -> None:
    """The engine averages gradients over its layout's groups, the script's attention and
    adapter exchange over the mpu's: they must be the same ranks."""
    for purpose, ranks in (("sequence", mpu.sequence_parallel_ranks()),
                           ("replicas", mpu.sequence_data_parallel_ranks())):
        if list(engine.mesh[purpose].ranks) != list(ranks):
            raise ValueError(
                f"deepspeed.initialize(mpu=...): the mpu's {'sequence' if purpose == 'sequence' else 'sequence-data'}"
                f"-parallel group is ranks {list(ranks)} but the config's layout puts ranks "
                f"{list(engine.mesh[purpose].ranks)} in it: the mpu's groups cover sequence and data parallelism "
                "only, so remove tensor_parallel and pipeline_parallel from the config")


def _pipeline_block(raw: dict, model: nn.Module) -> None:
    """A PipelineModule sets the number of stages (and how to split), as in DeepSpeed,
    where the config has no pipeline size of its own."""
    if not isinstance(model, PipelineModule):
        return
    wanted = model.pipeline_config()
    block = raw.setdefault("pipeline_parallel", {})
    if block.get("size", wanted["size"]) != wanted["size"]:
        raise ValueError(f"pipeline_parallel.size {block['size']} in the config, but the PipelineModule has "
                         f"num_stages={wanted['size']}: remove the config's size or make them equal")
    for key, value in wanted.items():
        block.setdefault(key, value)


def _deepspeed_wrapper(engine: DeepSpeedEngine, raw: dict) -> type[DeepSpeedOptimizer] | None:
    """The class of the optimizer DeepSpeed 0.19.8's engine builds for this config
    (`_do_optimizer_sanity_check`, `_configure_fp16_optimizer`): its ZeRO optimizers at
    stages 1-3, except `BF16_Optimizer` at stage 1 in bf16 with fp32 gradient accumulation
    and the optimizer not on the CPU; at stage 0 in fp16/bf16 `BF16_Optimizer` for a bf16
    pipeline, else `FP16_Optimizer` around its FusedAdam and `FP16_UnfusedOptimizer` around
    any other; in fp32 the torch optimizer itself."""
    stage = engine.zero_optimization_stage()
    if stage == 3:
        return DeepSpeedZeroOptimizer_Stage3
    if stage in (1, 2):
        accumulates_in_fp32 = engine.policies.precision.accumulation_dtype == torch.float32  # any spelling
        if (stage == 1 and engine.bfloat16_enabled() and accumulates_in_fp32
                and engine.policies.zero.offload_optimizer.device != "cpu"):
            return BF16_Optimizer
        return DeepSpeedZeroOptimizer
    if not (engine.fp16_enabled() or engine.bfloat16_enabled()):
        return None
    if engine.bfloat16_enabled() and isinstance(engine, PipelineEngine):
        return BF16_Optimizer
    return FP16_Optimizer if _steps_with_fused_adam(engine, raw) else FP16_UnfusedOptimizer


def _steps_with_fused_adam(engine: DeepSpeedEngine, raw: dict) -> bool:
    """Whether DeepSpeed's torch optimizer would be its FusedAdam: the config's `Adam` /
    `AdamW` unless `torch_adam` asks for torch's, or a `deepspeed.ops.adam.FusedAdam` the
    script passed (the engine steps that very object)."""
    block = raw.get("optimizer")
    if block is None:
        return engine.optimizer is not None and isinstance(engine.optimizer.optimizer, FusedAdam)
    return (str(block.get("type", "")).lower() in ("adam", "adamw")
            and not (block.get("params") or {}).get(TORCH_ADAM_PARAM, False))


def _clearing_model_gradients(engine: DeepSpeedEngine,
                              wrapper: type[DeepSpeedOptimizer] | None) -> torch.optim.Optimizer | None:
    """The torch optimizer over this rank's fp32 partition, whose `zero_grad()` also clears
    the model's gradients: a script's `optimizer.zero_grad()` means that, as on DeepSpeed's
    optimizer and on a plain torch optimizer over the model (a GAN clears the other
    model's gradients with it). The engine never calls it; it drops master gradients itself."""
    if engine.optimizer is None:  # no optimizer given: a forward-only engine, None as in DeepSpeed
        return None
    optimizer = engine.optimizer.optimizer
    for wrapped in (optimizer, engine.optimizer):  # isinstance(_, DeepSpeedOptimizer) as under DeepSpeed
        mark_wrapped(wrapped, wrapper)
    clear_masters = optimizer.zero_grad

    def zero_grad(set_to_none: bool = True) -> None:
        clear_masters(set_to_none)
        engine.module.zero_grad(set_to_none)

    optimizer.zero_grad = zero_grad
    if wrapper is not None and issubclass(wrapper, ZeROOptimizer):  # DeepSpeed's ZeRO optimizers move states too
        for wrapped in (optimizer, engine.optimizer):  # the one returned, and the engine's (OpenRLHF calls that)
            wrapped.offload_states, wrapped.reload_states = engine.offload_states, engine.reload_states
    if engine.policies.zero.partitions_parameters:  # where DeepSpeed's stage 3 keeps its module hooks
        offload = DeepSpeedZeRoOffload(engine.module, engine.zero.params.schedule)
        optimizer.parameter_offload = engine.optimizer.parameter_offload = offload
    return optimizer


def _choose_config(args: Any, config: Any) -> Any:
    if getattr(args, "deepscale_config", None) is not None:
        log.warning("--deepscale_config is deprecated: use --deepspeed_config")
        if getattr(args, "deepspeed_config", None) is not None:
            raise ValueError("both --deepscale_config and --deepspeed_config are given: keep --deepspeed_config")
        args.deepspeed_config, args.deepscale_config = args.deepscale_config, None
    from_args = getattr(args, "deepspeed_config", None)
    if from_args is not None and config is not None:
        raise ValueError(f"two configs: --deepspeed_config {from_args} and the config passed to "
                         "deepspeed.initialize(config=...); give one of them")
    chosen = config if config is not None else from_args
    if chosen is None:
        raise ValueError("deepspeed.initialize needs a config: pass config=... or run the script with "
                         "--deepspeed_config ds_config.json (after deepspeed.add_config_arguments(parser))")
    return chosen


def _align_local_rank(args: Any) -> None:
    """DeepSpeed overwrites args.local_rank with LOCAL_RANK, after checking they agree."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    given = getattr(args, "local_rank", None)
    if given is not None and given >= 0 and given != local_rank:
        raise ValueError(f"args.local_rank is {given} but this process's LOCAL_RANK is {local_rank}: pass the "
                         "--local_rank the launcher gives, or none")
    if args is not None and hasattr(args, "local_rank"):
        args.local_rank = local_rank


def _drop_overridden(raw: dict, block: str, passed: Any) -> None:
    if passed is not None and block in raw:
        del raw[block]
        log.warning("deepspeed.initialize: the %s passed in is used; the config's '%s' block is ignored",
                    "optimizer" if block == "optimizer" else "lr_scheduler", block)


def _param_groups(model: nn.Module, model_parameters: Iterable[Any] | None) -> list[dict[str, Any]]:
    """`model_parameters` as param groups: a list of dicts (kept), or of tensors (one
    group); None: every trainable parameter of the model."""
    items = list(model_parameters) if model_parameters is not None else [p for p in model.parameters() if p.requires_grad]
    if items and all(isinstance(item, dict) for item in items):
        return [dict(group, params=list(group["params"])) for group in items]
    if any(isinstance(item, dict) for item in items):
        raise ValueError("model_parameters mixes param-group dicts and tensors: give one kind")
    return [{"params": items}]


def _all_trainable_in_one_group(model: nn.Module, groups: list[dict[str, Any]]) -> bool:
    trainable = [id(param) for param in model.parameters() if param.requires_grad]
    return len(groups) == 1 and set(groups[0]) == {"params"} and [id(p) for p in groups[0]["params"]] == trainable
