"""A shardwise checkpoint in DeepSpeed's ZeRO-1/2 layout, so a user can go back to DeepSpeed
and continue the run there (`shardwise convert --to-deepspeed`).

DeepSpeed 0.19.8 resumes ZeRO optimizer files only at the data-parallel size that wrote
them, so the folder is written for the world size the DeepSpeed run will have: each
group's parameters back to back, cut into that many partitions (layout.py), rank r's
fp32 masters, Adam moments and step in `zero_pp_rank_r_mp_rank_00_optim_states.pt`, and
the weights (in the training dtype), scheduler, counters and client_state in
`mp_rank_00_model_states.pt`. DeepSpeed's ZeRO-1 and ZeRO-2 read the same files, so the
DeepSpeed config may use either stage.

What is not written (refused, naming the reason): fp16 runs (DeepSpeed's loss scaler
object carries its config's settings, which a shardwise checkpoint does not record),
optimizers other than Adam/AdamW, and checkpoints saved before the model description
recorded each parameter's param group.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch

from shardwise.frontends.deepspeed.checkpoints.layout import zero12_partition_size, zero12_spans
from shardwise.frontends.deepspeed.checkpoints.pickles import ZeroStageEnum, save_pickle
from shardwise.runtime.checkpoint.convert import open_verified
from shardwise.runtime.checkpoint.format import LATEST, VALUE, CheckpointError, check_tag
from shardwise.runtime.checkpoint.index import PieceIndex
from shardwise.runtime.checkpoint.state import decode_value

DEEPSPEED_VERSION = "0.19.8"  # the version whose layout this writes (its loader checks the field exists)
ADAM_CLASSES = frozenset({"Adam", "AdamW"})
ADAM_STATES = ("exp_avg", "exp_avg_sq")


def write_deepspeed_checkpoint(checkpoint_dir: str | os.PathLike, output: str | os.PathLike, *, world_size: int,
                               stage: int = 2, tag: str | None = None) -> Path:
    """Write shardwise's checkpoint `checkpoint_dir/tag` (None: the one `latest` names) as
    DeepSpeed's under `output/<tag>` for a DeepSpeed run of `world_size` data-parallel ranks
    at ZeRO `stage` (1 or 2), with `output/latest` naming it; returns the tag's folder."""
    if stage not in (1, 2):
        raise ValueError(f"--to-deepspeed writes ZeRO-1/2 files (DeepSpeed reads them at stage 1 or 2), not stage "
                         f"{stage}; train the DeepSpeed run at stage 1 or 2 to resume, then change the stage")
    if world_size < 1:
        raise ValueError(f"world_size must be positive, got {world_size}")
    directory, meta, records = open_verified(checkpoint_dir, tag)
    _check_convertible(directory, meta)
    out_tag = directory.name
    check_tag(out_tag)
    folder = Path(output) / out_tag
    folder.mkdir(parents=True, exist_ok=True)
    groups = _groups(meta)
    steps = _group_steps(records, len(groups))
    with PieceIndex(directory, records) as index:
        save_pickle(_model_file(meta, index, groups, world_size, stage), folder / "mp_rank_00_model_states.pt")
        for rank in range(world_size):
            state = _optimizer_file(meta, index, groups, steps, world_size, rank, stage)
            save_pickle(state, folder / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    (Path(output) / LATEST).write_text(out_tag)
    return folder


def _check_convertible(directory: Path, meta: dict) -> None:
    optimizer = meta["optimizer"]["class"]
    if optimizer not in ADAM_CLASSES:
        raise CheckpointError(f"{directory} was trained with {optimizer}; --to-deepspeed writes Adam/AdamW state "
                              "(DeepSpeed's ZeRO files keep its moments by the optimizer's own layout)")
    if meta.get("loss_scaler") is not None:
        raise CheckpointError(f"{directory} is an fp16 run with a dynamic loss scale: DeepSpeed's checkpoint holds "
                              "its loss-scaler object with the config's scaling settings, which shardwise's "
                              "checkpoint does not record; convert a bf16 or fp32 run")
    if meta.get("tensor_parallel") is not None:
        raise CheckpointError(f"{directory} was trained with tensor parallelism; --to-deepspeed writes data-parallel "
                              "(ZeRO-1/2) checkpoints only")
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


def _model_file(meta: dict, index: PieceIndex, groups: list[list[dict]], world_size: int, stage: int) -> dict:
    """DeepSpeed's mp_rank_00_model_states.pt: the module's state_dict in the training dtype."""
    training = _dtype(meta["dtype"])
    module: dict[str, torch.Tensor] = {}
    buffers = [item["name"] for item in meta["buffers"]]
    for item in meta["parameters"] + meta["buffers"]:
        numel = math.prod(item["shape"])
        stored = _dtype(item["dtype"])
        value = index.read(item["name"], VALUE, 0, numel, stored).reshape(item["shape"])
        trained = item["name"] not in buffers and stored.is_floating_point
        module[item["name"]] = value.to(training) if trained else value
    frozen = {item["name"]: torch.Size(item["shape"]) for item in meta["parameters"] if not item["trainable"]}
    counters = meta["counters"]
    precision = {"bfloat16": {"bf16": {"enabled": True}}, "float16": {"fp16": {"enabled": True}}}.get(meta["dtype"], {})
    samples = (meta.get("deepspeed") or {}).get("global_samples")  # absent: DeepSpeed counts steps x batch size
    return {
        **({"global_samples": samples} if samples is not None else {}),
        "module": module,
        "buffer_names": buffers,
        "optimizer": None,
        "param_shapes": [{item["name"]: torch.Size(item["shape"]) for item in group} for group in groups],
        "frozen_param_shapes": frozen,
        "shared_params": {},
        "frozen_param_fragments": {name: module[name].reshape(-1) for name in frozen},
        "lr_scheduler": None if meta["lr_scheduler"] is None else decode_value(meta["lr_scheduler"]),
        "data_sampler": None,
        "random_ltd": None,
        "skipped_steps": counters["skipped_steps"],
        "global_steps": counters["global_steps"],
        "dp_world_size": world_size,
        "mp_world_size": 1,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        "ds_config": {"zero_optimization": {"stage": stage}, "optimizer": {"type": meta["optimizer"]["class"]},
                      "gradient_accumulation_steps": counters["gradient_accumulation_steps"], **precision},
        "ds_version": DEEPSPEED_VERSION,
        **meta["client_state"],
    }


def _optimizer_file(meta: dict, index: PieceIndex, groups: list[list[dict]], steps: list[int], world_size: int,
                    rank: int, stage: int) -> dict:
    """Rank `rank`'s zero_pp_rank file: its partition of every group's masters and moments.
    The loss scaler and gradient clipping are left out: DeepSpeed then keeps its config's."""
    masters, paddings, states, param_groups = [], [], {}, []
    for number, group in enumerate(groups):
        names = [item["name"] for item in group]
        numels = [math.prod(item["shape"]) for item in group]
        size = zero12_partition_size(numels, world_size)
        flat = {key: torch.zeros(size) for key in (VALUE, *ADAM_STATES)}
        for span in zero12_spans(names, numels, size, rank):
            for key, tensor in flat.items():  # a state the checkpoint lacks (a group never stepped) stays zero
                index.read_into(span.name, key, span.start, tensor[span.offset : span.offset + span.stop - span.start])
        padding = size * world_size - sum(numels) if rank == world_size - 1 else 0
        masters.append(flat[VALUE][: size - padding].clone())
        paddings.append(padding)
        states[number] = {"step": steps[number], **{key: flat[key] for key in ADAM_STATES}}
        hyper = {key: decode_value(value) for key, value in meta["optimizer"]["param_groups"][number].items()}
        param_groups.append(_deepspeed_group(hyper, number))
    return {
        "optimizer_state_dict": {
            "base_optimizer_state": {"state": states, "param_groups": param_groups},
            "single_partition_of_fp32_groups": masters,
            "zero_stage": ZeroStageEnum(stage),
            "group_paddings": paddings,
            "param_alignment_paddings": [[0] * len(group) for group in groups],
            "partition_count": [world_size] * len(groups),
            "ds_version": DEEPSPEED_VERSION,
        },
        "ds_version": DEEPSPEED_VERSION,
    }


def _deepspeed_group(hyper: dict[str, Any], number: int) -> dict[str, Any]:
    """A param group as DeepSpeed's Adam keeps it: torch's hyper-parameters, betas as a list,
    and the keys its fused kernel reads (`bias_correction`, the group `step`)."""
    group = {key: list(value) if isinstance(value, tuple) else value for key, value in hyper.items()}
    group.setdefault("bias_correction", True)
    group.setdefault("step", 0)
    group["params"] = [number]
    return group
