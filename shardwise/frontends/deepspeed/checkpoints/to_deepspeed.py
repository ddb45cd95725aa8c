"""A shardwise checkpoint in DeepSpeed's layouts, so a user can go back to DeepSpeed and
continue the run there (`shardwise convert --to-deepspeed`, the compatibility engine's
`save_deepspeed_checkpoint`).

DeepSpeed 0.19.8 resumes ZeRO optimizer files only at the data-parallel size that wrote
them, so the folder is written for the world size the DeepSpeed run will have, in the
layout its ZeRO stage reads (layout.py says where each element goes):

- ZeRO-1/2: each group's parameters back to back, cut into that many partitions; rank r's
  fp32 masters, Adam moments and step in `zero_pp_rank_r_mp_rank_00_optim_states.pt`, the
  weights (in the training dtype), scheduler, counters and client_state in
  `mp_rank_00_model_states.pt`. DeepSpeed's ZeRO-1 and ZeRO-2 read the same files, and so
  does its BF16 optimizer (bf16 with fp32 gradient accumulation), which pads the masters
  back itself.
- ZeRO-3: every parameter cut on its own, each group's pieces back to back in sub-groups
  of `sub_group_size` elements as DeepSpeed forms them (`zero_pp_rank_r_mp_rank_00_optim_
  states.pt`, with the static loss scaler DeepSpeed's ZeRO-3 loader requires), and a model
  file per rank (`zero_pp_rank_r_mp_rank_00_model_states.pt`) whose parameters are empty,
  as DeepSpeed's partitioned ones are, beside that rank's pieces of the frozen ones.
- A pipeline (`pipeline_parts`: DeepSpeed's `PipelineModule.parts`, the first layer of each
  stage and the layer count): each layer's state_dict in `layer_LL-model_states.pt`, and
  per stage s a model file `mp_rank_SS_model_states.pt` and the ZeRO-1 files of that
  stage's parameters, `zero_pp_rank_r_mp_rank_SS_optim_states.pt`. shardwise names a
  PipelineModule's parameters `layers.L.NAME`; DeepSpeed `L.NAME`.

bf16 runs write the optimizer files as `bf16_zero_pp_rank_...`, the only name DeepSpeed's
bf16 engine looks for.

What is not written (refused, naming the reason): fp16 runs (DeepSpeed's loss scaler
object carries its config's settings, which a shardwise checkpoint does not record),
optimizers other than Adam/AdamW, tensor parallelism, and checkpoints saved before the
model description recorded each parameter's param group.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from shardwise.frontends.deepspeed.checkpoints.layout import (
    zero3_piece,
    zero3_spans,
    zero12_partition_size,
    zero12_spans,
)
from shardwise.frontends.deepspeed.checkpoints.pickles import LossScaler, ZeroStageEnum, save_pickle
from shardwise.runtime.checkpoint.convert import open_verified
from shardwise.runtime.checkpoint.format import LATEST, VALUE, CheckpointError, check_tag
from shardwise.runtime.checkpoint.index import PieceIndex
from shardwise.runtime.checkpoint.state import decode_value

DEEPSPEED_VERSION = "0.19.8"  # the version whose layout this writes (its loader checks the field exists)
ADAM_CLASSES = frozenset({"Adam", "AdamW"})
ADAM_STATES = ("exp_avg", "exp_avg_sq")
SUB_GROUP_SIZE = 1_000_000_000  # DeepSpeed's default zero_optimization.sub_group_size
PIPELINE_NAME = re.compile(r"layers\.(\d+)\.(.+)")  # how shardwise's PipelineModule names a layer's tensors


@dataclass(frozen=True)
class _Target:
    """What the DeepSpeed run will be: its data-parallel size, ZeRO stage, file prefix."""

    world_size: int
    stage: int
    prefix: str  # "bf16_" for a bf16 run's optimizer files
    sub_group_size: int


def write_deepspeed_checkpoint(checkpoint_dir: str | os.PathLike, output: str | os.PathLike, *, world_size: int,
                               stage: int = 2, tag: str | None = None, pipeline_parts: list[int] | None = None,
                               sub_group_size: int = SUB_GROUP_SIZE) -> Path:
    """Write shardwise's checkpoint `checkpoint_dir/tag` (None: the one `latest` names) as
    DeepSpeed's under `output/<tag>` for a DeepSpeed run of `world_size` data-parallel ranks
    at ZeRO `stage` (1, 2 or 3; a pipeline: 1), with `output/latest` naming it; returns the
    tag's folder. `pipeline_parts`: the DeepSpeed PipelineModule's `parts` (stage s runs
    layers parts[s] to parts[s + 1] - 1) for a PipelineModule's checkpoint; `sub_group_size`:
    the DeepSpeed run's `zero_optimization.sub_group_size` (ZeRO-3)."""
    if stage not in (1, 2, 3):
        raise ValueError(f"--to-deepspeed writes ZeRO-1/2/3 files, not stage {stage}; train the DeepSpeed run at "
                         "stage 1, 2 or 3 to resume, then change the stage")
    if pipeline_parts is not None and (len(pipeline_parts) < 2 or pipeline_parts[0] != 0
                                       or any(b <= a for a, b in zip(pipeline_parts, pipeline_parts[1:]))):
        raise ValueError(f"pipeline_parts {pipeline_parts}: give DeepSpeed's PipelineModule.parts, the first layer "
                         "of each stage and then the number of layers (e.g. 0,4,8 for two stages of four layers)")
    if pipeline_parts is not None and stage != 1:
        raise ValueError(f"a pipeline is written for DeepSpeed's ZeRO-1 (its pipeline engine refuses ZeRO-2/3), not "
                         f"stage {stage}")
    if world_size < 1:
        raise ValueError(f"world_size must be positive, got {world_size}")
    if sub_group_size < 0:
        raise ValueError(f"sub_group_size must be a number of elements (0: one parameter per sub-group, as "
                         f"DeepSpeed reads it), got {sub_group_size}")
    directory, meta, records = open_verified(checkpoint_dir, tag)
    _check_convertible(directory, meta)
    out_tag = directory.name
    check_tag(out_tag)
    folder = Path(output) / out_tag
    folder.mkdir(parents=True, exist_ok=True)
    target = _Target(world_size, stage, "bf16_" if meta["dtype"] == "bfloat16" else "", sub_group_size)
    groups = _groups(meta)
    steps = _group_steps(records, len(groups))
    with PieceIndex(directory, records) as index:
        if pipeline_parts is not None:
            _write_pipeline(folder, meta, index, groups, steps, target, pipeline_parts)
        elif stage == 3:
            _write_zero3(folder, meta, index, groups, steps, target)
        else:
            model = _model_file(meta, _module(meta, index), groups, target, dp_world_size=world_size)
            save_pickle(model, folder / "mp_rank_00_model_states.pt")
            _write_zero12(folder, meta, index, groups, steps, target, mp_rank=0)
    (Path(output) / LATEST).write_text(out_tag)
    return folder


def _check_convertible(directory: Path, meta: dict) -> None:
    optimizer = meta["optimizer"]["class"]
    if optimizer not in ADAM_CLASSES:
        raise CheckpointError(f"{directory} was trained with {optimizer}; --to-deepspeed writes Adam/AdamW state "
                              "(DeepSpeed's ZeRO files keep its moments by the optimizer's own layout)")
    if meta.get("loss_scaler") is not None or meta["dtype"] == "float16":
        raise CheckpointError(f"{directory} is an fp16 run: DeepSpeed's checkpoint holds its loss-scaler object with "
                              "the config's scaling settings, which shardwise's checkpoint does not record; convert "
                              "a bf16 or fp32 run")
    if meta.get("tensor_parallel") is not None:
        raise CheckpointError(f"{directory} was trained with tensor parallelism; --to-deepspeed writes data-parallel "
                              "and pipeline checkpoints only")
    trained = [parameter for parameter in meta["parameters"] if parameter["trainable"]]
    if any("group" not in parameter for parameter in trained):
        raise CheckpointError(f"{directory} does not record each parameter's optimizer param group (saved by an "
                              "older shardwise): resume it once with shardwise and save again, then convert")


def _groups(meta: dict) -> list[list[dict]]:
    """Each param group's parameters, in the model's order (the order DeepSpeed's flat buffers
    use when a script builds its groups from the model's parameters in order)."""
    count = len(meta["optimizer"]["param_groups"])
    groups: list[list[dict]] = [[] for _ in range(count)]
    for parameter in meta["parameters"]:
        if parameter["trainable"]:
            groups[parameter["group"]].append(parameter)
    return groups


def _group_steps(records: list[dict], count: int) -> list[int]:
    steps = [0] * count
    for record in records:
        for group, state in record.get("optimizer_groups", {}).items():
            step = state["scalars"].get("step")
            if step is not None:
                steps[int(group)] = int(decode_value(step))
    return steps


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _numel(item: dict) -> int:
    return math.prod(item["shape"])


def _module(meta: dict, index: PieceIndex) -> dict[str, torch.Tensor]:
    """The module's state_dict as DeepSpeed saves it: trained weights in the training dtype,
    frozen parameters and buffers as stored."""
    training = _dtype(meta["dtype"])
    buffers = {item["name"] for item in meta["buffers"]}
    module: dict[str, torch.Tensor] = {}
    for item in meta["parameters"] + meta["buffers"]:
        stored = _dtype(item["dtype"])
        value = index.read(item["name"], VALUE, 0, _numel(item), stored).reshape(item["shape"])
        trained = item["name"] not in buffers and stored.is_floating_point
        module[item["name"]] = value.to(training) if trained else value
    return module


def _model_file(meta: dict, module: dict[str, torch.Tensor] | None, groups: list[list[dict]], target: _Target, *,
                dp_world_size: int, frozen_fragments: dict[str, torch.Tensor] | None = None,
                pipeline_stages: int = 1, rename: Callable[[str], str] | None = None) -> dict:
    """A DeepSpeed model-states file: the module (None for a pipeline, whose layers have their
    own files), each group's parameter shapes, scheduler, counters and client_state."""
    rename = rename or (lambda name: name)
    buffers = [rename(item["name"]) for item in meta["buffers"]]
    frozen = [item for item in meta["parameters"] if not item["trainable"]]
    counters = meta["counters"]
    precision = {"bfloat16": {"bf16": {"enabled": True}}}.get(meta["dtype"], {})
    samples = (meta.get("deepspeed") or {}).get("global_samples")  # absent: DeepSpeed counts steps x batch size
    if module is None:  # a pipeline stage: DeepSpeed records no frozen parameters here
        frozen_shapes, fragments = None, None
    else:
        frozen_shapes = {item["name"]: torch.Size(item["shape"]) for item in frozen}
        fragments = frozen_fragments if frozen_fragments is not None else {
            item["name"]: module[item["name"]].reshape(-1) for item in frozen}
    return {
        **({"global_samples": samples} if samples is not None else {}),
        "module": module,
        "buffer_names": buffers,
        "optimizer": None,
        "param_shapes": [{rename(item["name"]): torch.Size(item["shape"]) for item in group} for group in groups],
        "frozen_param_shapes": frozen_shapes,
        "shared_params": {},
        "frozen_param_fragments": fragments,
        "lr_scheduler": None if meta["lr_scheduler"] is None else decode_value(meta["lr_scheduler"]),
        "data_sampler": None,
        "random_ltd": meta.get("random_ltd"),  # DeepSpeed resumes its scheduler from it
        "skipped_steps": counters["skipped_steps"],
        "global_steps": counters["global_steps"],
        "dp_world_size": dp_world_size,
        "mp_world_size": pipeline_stages,
        "checkpoint_parallel_dimensions": {"pp_degree": pipeline_stages, "tp_degree": 1},
        "ds_config": {"zero_optimization": {"stage": target.stage}, "optimizer": {"type": meta["optimizer"]["class"]},
                      "gradient_accumulation_steps": counters["gradient_accumulation_steps"], **precision},
        "ds_version": DEEPSPEED_VERSION,
        **meta["client_state"],
    }


# -- ZeRO-1/2 ---------------------------------------------------------------------------------------
def _write_zero12(folder: Path, meta: dict, index: PieceIndex, groups: list[list[dict]], steps: list[int],
                  target: _Target, *, mp_rank: int) -> None:
    for rank in range(target.world_size):
        state = _zero12_optimizer_file(meta, index, groups, steps, target, rank)
        save_pickle(state, folder / f"{target.prefix}zero_pp_rank_{rank}_mp_rank_{mp_rank:02d}_optim_states.pt")


def _zero12_optimizer_file(meta: dict, index: PieceIndex, groups: list[list[dict]], steps: list[int],
                           target: _Target, rank: int) -> dict:
    """Rank `rank`'s zero_pp_rank file: its partition of every group's masters and moments.
    The loss scaler and gradient clipping are left out: DeepSpeed then keeps its config's."""
    world_size = target.world_size
    masters, paddings, states, param_groups = [], [], {}, []
    for number, group in enumerate(groups):
        names = [item["name"] for item in group]
        numels = [_numel(item) for item in group]
        size = zero12_partition_size(numels, world_size)
        flat = {key: torch.zeros(size) for key in (VALUE, *ADAM_STATES)}
        for span in zero12_spans(names, numels, size, rank):
            for key, tensor in flat.items():  # a state the checkpoint lacks (a group never stepped) stays zero
                index.read_into(span.name, key, span.start, tensor[span.offset : span.offset + span.stop - span.start])
        padding = size * world_size - sum(numels) if rank == world_size - 1 else 0
        masters.append(flat[VALUE][: size - padding].clone())
        paddings.append(padding)
        states[number] = {"step": steps[number], **{key: flat[key] for key in ADAM_STATES}}
        param_groups.append(_deepspeed_group(meta, number, [number]))
    return {
        "optimizer_state_dict": {
            "base_optimizer_state": {"state": states, "param_groups": param_groups},
            "single_partition_of_fp32_groups": masters,
            "zero_stage": ZeroStageEnum(target.stage),
            "group_paddings": paddings,
            "param_alignment_paddings": [[0] * len(group) for group in groups],
            "partition_count": [world_size] * len(groups),
            "ds_version": DEEPSPEED_VERSION,
        },
        "ds_version": DEEPSPEED_VERSION,
    }


# -- ZeRO-3 -----------------------------------------------------------------------------------------
def _sub_groups(group: list[dict], target: _Target) -> list[list[dict]]:
    """DeepSpeed's ZeRO-3 sub-groups of one param group: parameters in order, a sub-group
    closed once its pieces reach sub_group_size elements (the whole group when it is smaller)."""
    pieces = [zero3_piece(_numel(item), target.world_size) for item in group]
    if target.sub_group_size >= sum(pieces):
        return [group]
    runs, run, size = [], [], 0
    for item, piece in zip(group, pieces):
        run.append(item)
        size += piece
        if size >= target.sub_group_size or item is group[-1]:
            runs.append(run)
            run, size = [], 0
    return runs


def _write_zero3(folder: Path, meta: dict, index: PieceIndex, groups: list[list[dict]], steps: list[int],
                 target: _Target) -> None:
    sub_groups = [(number, run) for number, group in enumerate(groups) for run in _sub_groups(group, target)]
    module = _module(meta, index)
    parameters = {item["name"] for item in meta["parameters"]}
    frozen = [item for item in meta["parameters"] if not item["trainable"]]
    for rank in range(target.world_size):  # partitioned parameters are empty in the module, as DeepSpeed's are
        partitioned = {name: tensor.new_empty(0) if name in parameters else tensor for name, tensor in module.items()}
        fragments = {item["name"]: _zero3_fragment(module[item["name"]], target.world_size, rank) for item in frozen}
        model = _model_file(meta, partitioned, [run for _, run in sub_groups], target,
                            dp_world_size=target.world_size, frozen_fragments=fragments)
        save_pickle(model, folder / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt")
        state = _zero3_optimizer_file(meta, index, sub_groups, steps, target, rank)
        save_pickle(state, folder / f"{target.prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")


def _zero3_fragment(tensor: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s piece of a whole (frozen) parameter, the last padded with zeros."""
    piece = zero3_piece(tensor.numel(), world_size)
    out = torch.zeros(piece, dtype=tensor.dtype)
    flat = tensor.reshape(-1)[rank * piece : (rank + 1) * piece]
    out[: flat.numel()] = flat
    return out


def _zero3_optimizer_file(meta: dict, index: PieceIndex, sub_groups: list[tuple[int, list[dict]]],
                          steps: list[int], target: _Target, rank: int) -> dict:
    """Rank `rank`'s ZeRO-3 file: per sub-group its pieces' masters and moments; the optimizer's
    param groups list their sub-groups, as DeepSpeed's state_dict numbers them."""
    flats, states = [], {}
    for sub_group, (number, run) in enumerate(sub_groups):
        names = [item["name"] for item in run]
        numels = [_numel(item) for item in run]
        size = sum(zero3_piece(numel, target.world_size) for numel in numels)
        flat = {key: torch.zeros(size) for key in (VALUE, *ADAM_STATES)}
        for span in zero3_spans(names, numels, target.world_size, rank):
            for key, tensor in flat.items():
                index.read_into(span.name, key, span.start, tensor[span.offset : span.offset + span.stop - span.start])
        flats.append(flat[VALUE])
        states[sub_group] = {"step": steps[number], **{key: flat[key] for key in ADAM_STATES}}
    param_groups = [_deepspeed_group(meta, number, [position for position, (owner, _) in enumerate(sub_groups)
                                                    if owner == number])
                    for number in range(len(meta["optimizer"]["param_groups"]))]
    return {
        "optimizer_state_dict": {
            "zero_stage": ZeroStageEnum.weights,
            "loss_scaler": LossScaler(cur_scale=1.0, dynamic=False),
            "dynamic_loss_scale": False,
            "overflow": False,
            "partition_count": target.world_size,
            "optimizer_state_dict": {"state": states, "param_groups": param_groups},
            "fp32_flat_groups": flats,
        },
        "ds_version": DEEPSPEED_VERSION,
    }


# -- a pipeline -------------------------------------------------------------------------------------
def _write_pipeline(folder: Path, meta: dict, index: PieceIndex, groups: list[list[dict]], steps: list[int],
                    target: _Target, parts: list[int]) -> None:
    module = _module(meta, index)
    layer_of: dict[str, int] = {}
    for name in module:
        match = PIPELINE_NAME.fullmatch(name)
        if match is None or int(match.group(1)) >= parts[-1]:
            raise CheckpointError(f"{name} is not a layer of a PipelineModule of {parts[-1]} layers (shardwise names "
                                  "them layers.L.NAME): write the checkpoint of a PipelineModule, with the DeepSpeed "
                                  "run's parts")
        layer_of[name] = int(match.group(1))
    for layer in range(parts[-1]):  # DeepSpeed loads every layer's file, parameterless ones too
        state = {PIPELINE_NAME.fullmatch(name).group(2): tensor for name, tensor in module.items()
                 if layer_of[name] == layer}
        save_pickle(state, folder / f"layer_{layer:02d}-model_states.pt")

    def rename(name: str) -> str:
        return name.removeprefix("layers.")

    stages = len(parts) - 1
    for stage in range(stages):
        mine = range(parts[stage], parts[stage + 1])
        stage_groups = [[item for item in group if layer_of[item["name"]] in mine] for group in groups]
        empty = [number for number, group in enumerate(stage_groups) if not group]
        if empty:
            raise CheckpointError(f"pipeline stage {stage} (layers {mine.start}-{mine.stop - 1}) has no parameter of "
                                  f"param group(s) {empty}; DeepSpeed's ZeRO-1 files need every group on every stage")
        stage_meta = {**meta, "buffers": [item for item in meta["buffers"] if layer_of[item["name"]] in mine]}
        model = _model_file(stage_meta, None, stage_groups, target, dp_world_size=target.world_size,
                            pipeline_stages=stages, rename=rename)
        save_pickle(model, folder / f"mp_rank_{stage:02d}_model_states.pt")
        _write_zero12(folder, meta, index, stage_groups, steps, target, mp_rank=stage)


def _deepspeed_group(meta: dict, number: int, params: list[int]) -> dict[str, Any]:
    """Param group `number` as DeepSpeed's Adam keeps it: torch's hyper-parameters, betas as a
    list, and the keys its fused kernel reads (`bias_correction`, the group `step`)."""
    hyper = {key: decode_value(value) for key, value in meta["optimizer"]["param_groups"][number].items()}
    group = {key: list(value) if isinstance(value, tuple) else value for key, value in hyper.items()}
    group.setdefault("bias_correction", True)
    group.setdefault("step", 0)
    group["params"] = params
    return group
