"""The experts of expert-parallel layers in a checkpoint (runtime/parallel/expert/).

Experts train apart from ZeRO's stores (parallel/expert/training.py): each rank holds
whole parameters of its 1/P of a layer's experts, under the layer's local names, in flat
buckets (a param group's experts of one size), and a torch optimizer of their own over
its slice of each bucket (its 1/N at ZeRO >= 1). They are written as ordinary pieces:
each slice once, cut into the ranges of the parameters it covers, named by the
parameter's name in the every-expert model (`global_expert_name`) and element range,
with the fp32 master values and every per-element optimizer state. So the index finds
them whatever the layout that reads them, as it finds the dense pieces: a checkpoint
resumes at another world size, data-parallel size or expert-parallel size (> 1), the
experts regrouped, and exports to one file with every expert. The experts' optimizer
scalars are kept per expert param group in each rank's record; their param groups and
schedule in the meta.

A model that trains the experts as dense parameters (ep_size 1) has other optimizer
groups than the run that saved them apart, so loading across that line is refused with
the reason.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from shardwise.runtime.checkpoint.format import VALUE, CheckpointError
from shardwise.runtime.checkpoint.index import PieceIndex
from shardwise.runtime.checkpoint.safetensors_io import DTYPES, dtype_name
from shardwise.runtime.checkpoint.state import decode_value, describe_optimizer, encode_value
from shardwise.runtime.engine_protocol import EngineProtocol


def expert_meta(engine: EngineProtocol) -> dict[str, Any]:
    """The meta's `experts` entry: the saving layout (for the reader), the experts' param
    groups' hyper-parameters and their schedule."""
    optimizer, scheduler = engine.experts.optimizer, engine.expert_lr_scheduler
    return {
        "layout": {"world_size": engine.world_size, "data_size": engine.mesh.data_size,
                   "ep_sizes": sorted({size for _, _, size in engine.experts.params})},
        "groups": len({bucket.group for bucket in engine.experts.buckets}),
        "bucket_groups": [bucket.group for bucket in engine.experts.buckets],  # of each optimizer param group
        "optimizer": describe_optimizer(optimizer, "expert param group"),
        "lr_scheduler": None if scheduler is None else encode_value(scheduler.state_dict(),
                                                                   "expert lr scheduler state"),
    }


def describe_experts(engine: EngineProtocol) -> list[dict[str, Any]]:
    """This rank's experts as the meta lists parameters: every-expert names, fp32 masters."""
    experts = engine.experts
    return [{"name": experts.global_names[id(param)], "shape": list(param.shape), "trainable": True,
             "dtype": "float32"} for _, param, _ in experts.params]


def expert_pieces(engine: EngineProtocol) -> tuple[list[tuple[str, int, int, dict[str, torch.Tensor]]], dict]:
    """The pieces this rank writes (every-expert name, start, stop, {VALUE: master values,
    state: values}) and its record: per expert param group, the optimizer's scalar state
    and the dtypes of its per-element states."""
    experts = engine.experts
    pieces, groups = [], {}
    for bucket in experts.buckets:
        state = experts.optimizer.state.get(bucket.master, {})
        elements, scalars = {}, {}
        for key, value in state.items():
            if torch.is_tensor(value) and value.dim() > 0:
                if value.shape != bucket.master.shape:
                    raise CheckpointError(f"optimizer state {key!r} of the experts of param group {bucket.group} "
                                          f"has shape {tuple(value.shape)}, not their slice's "
                                          f"{tuple(bucket.master.shape)}; checkpoints store per-element state")
                elements[key] = value.detach()
            else:
                scalars[key] = encode_value(value, f"optimizer state {key!r} of expert param group {bucket.group}")
        if state:
            groups.setdefault(str(bucket.group), {"scalars": scalars, "elements": {
                key: dtype_name(value.dtype) for key, value in elements.items()}})
        if not bucket.writes:
            continue
        master = bucket.master.detach()
        for index, start, stop, at in bucket.owned_pieces():
            name = experts.global_names[id(bucket.params[index][1])]
            width = stop - start
            named = {VALUE: master[at : at + width]}
            named.update({key: value[at : at + width] for key, value in elements.items()})
            pieces.append((name, start, stop, named))
    return pieces, {"groups": groups}


def check_expert_layout(engine: EngineProtocol, meta: dict, directory: Path) -> None:
    """Refuse, before anything is read, a checkpoint whose experts this engine cannot take."""
    saved = meta.get("experts")
    if saved is None and engine.experts is None:
        return
    if saved is None:
        raise CheckpointError(f"checkpoint {directory} was saved without expert parallelism (ep_size 1, or by "
                              "another format), and this engine trains its experts apart (ep_size > 1), with "
                              "optimizer groups of their own: resume it with ep_size 1")
    if engine.experts is None:
        raise CheckpointError(f"checkpoint {directory} trained its experts apart (ep_size "
                              f"{saved['layout']['ep_sizes']}), with optimizer groups of their own, and this engine "
                              "trains none apart: resume it with ep_size > 1 (any that divides the experts and the "
                              "data-parallel size), or export its weights with shardwise convert")
    groups = len({bucket.group for bucket in engine.experts.buckets})
    if saved["groups"] != groups:
        raise CheckpointError(f"checkpoint {directory} has {saved['groups']} expert param group(s), this engine's "
                              f"experts have {groups}")


def load_experts(engine: EngineProtocol, index: PieceIndex, meta: dict, records: list[dict], *,
                 optimizer_states: bool, schedule: bool) -> None:
    """Fill this rank's slice of every bucket from the pieces that hold it (any saving
    layout), then its replicas' slices by all-gather; `optimizer_states`: the optimizer's
    state of the slice and the experts' hyper-parameters; `schedule`: their schedule."""
    experts = engine.experts
    saved = meta["experts"]
    scalars: dict[str, dict] = {}
    elements: dict[str, dict] = {}
    for record in records:
        for group, state in record.get("experts", {}).get("groups", {}).items():
            scalars.setdefault(group, state["scalars"])
            elements.setdefault(group, state["elements"])
    states: dict[int, dict[str, torch.Tensor]] = {}
    with torch.no_grad():
        for position, bucket in enumerate(experts.buckets):
            master = bucket.master.data
            parts = {key: torch.zeros(master.numel(), dtype=DTYPES[dtype], device=master.device)
                     for key, dtype in elements.get(str(bucket.group), {}).items()} if optimizer_states else {}
            for param_index, start, stop, at in bucket.owned_pieces():
                name = experts.global_names[id(bucket.params[param_index][1])]
                index.read_into(name, VALUE, start, master[at : at + stop - start])
                for key, tensor in parts.items():
                    index.read_into(name, key, start, tensor[at : at + stop - start])
            bucket.after_step()  # the master into the compute-dtype buffer, the slices to every replica
            if str(bucket.group) in scalars and optimizer_states:
                states[position] = {**{key: decode_value(value) for key, value in scalars[str(bucket.group)].items()},
                                    **{key: tensor.view(master.shape) for key, tensor in parts.items()}}
    if optimizer_states:
        optimizer = experts.optimizer
        if saved["optimizer"]["class"] != type(optimizer).__name__:
            raise CheckpointError(f"the experts were trained with {saved['optimizer']['class']}, this engine "
                                  f"trains them with {type(optimizer).__name__}")
        hyper: dict[int, dict] = {}  # per expert param group: its saved buckets share hyper-parameters
        for group, values in zip(saved["bucket_groups"], saved["optimizer"]["param_groups"]):
            hyper.setdefault(group, values)
        groups = []
        for position, group in enumerate(optimizer.param_groups):
            kept = {key: value for key, value in group.items() if key != "params"}
            kept.update({key: decode_value(value) for key, value in hyper[experts.buckets[position].group].items()})
            groups.append({**kept, "params": [position]})
        optimizer.load_state_dict({"state": states, "param_groups": groups})
    if schedule and engine.expert_lr_scheduler is not None and saved["lr_scheduler"] is not None:
        engine.expert_lr_scheduler.load_state_dict(decode_value(saved["lr_scheduler"]))
