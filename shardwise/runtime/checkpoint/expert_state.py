"""The experts of expert-parallel layers in a checkpoint (runtime/parallel/expert/).

Experts train apart from ZeRO's stores (parallel/expert/training.py): each rank holds
whole parameters of its 1/P of a layer's experts, under the layer's local names, in flat
buckets (a param group's experts of one size), and a torch optimizer of their own over
its slice of each bucket (its 1/N at ZeRO >= 1). They are written as ordinary pieces:
each slice once, cut into the ranges of the parameters it covers, placed in the
every-expert model (`global_expert_place`: name and element range), with the fp32
master values and every per-element optimizer state. An expert that is a slice of
stacked experts (Hugging Face Mixtral's (E, ...) tensors) is a range of the stacked
parameter (`ExpertPlace.offset`), so its pieces are too; a tensor-parallel expert's block
is cut into the runs its placement maps it to (`_global_runs`). So the index finds them
whatever the layout that reads them, as it finds the dense pieces: a checkpoint resumes
at another world size, data-parallel size or expert-parallel size, the experts
regrouped, and exports to one file with every expert. The experts' optimizer
scalars are kept per expert param group in each rank's record; their param groups and
schedule in the meta.

A model that trains the experts as dense parameters (ep_size 1) finds the experts'
pieces under the same names; its optimizer groups differ from a run that trained them
apart, and `align_expert_layout` matches them up either way (or refuses, with the
reason, groups it cannot match).
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
from shardwise.runtime.parallel.expert import ExpertPlace
from shardwise.runtime.parallel.tensor.placement import tensor_shard


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
    places = [experts.global_places[id(param)] for _, param, _ in experts.params]
    return [{"name": place.name, "shape": list(place.shape), "trainable": True, "dtype": "float32"}
            for place in places]


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
            param = bucket.params[index][1]
            place = experts.global_places[id(param)]
            for low, high, position in _global_runs(place, param, start, stop):
                first, width = at + position, high - low
                named = {VALUE: master[first : first + width]}
                named.update({key: value[first : first + width] for key, value in elements.items()})
                pieces.append((place.name, low, high, named))
    return pieces, {"groups": groups}


def _global_runs(place: ExpertPlace, param: torch.Tensor, start: int, stop: int) -> list[tuple[int, int, int]]:
    """Elements [start, stop) of an expert parameter as this rank holds it, as runs of the
    every-expert parameter's flat elements: (start, stop, position in [start, stop)). A
    tensor-parallel expert's block is not one range of the expert; its placement maps it."""
    shard = tensor_shard(param)
    runs = [(start, stop, 0)] if shard is None else shard.global_runs(start, stop)
    return [(place.offset + low, place.offset + high, position) for low, high, position in runs]


def align_expert_layout(engine: EngineProtocol, meta: dict, records: list[dict],
                        directory: Path) -> tuple[dict, list[dict]]:
    """The checkpoint's meta and records as this engine's layout reads them, or a refusal
    before anything is read. Across the line between experts trained among the dense
    parameters (ep_size 1) and apart (ep_size > 1), the pieces need nothing: experts are
    named as in the every-expert model either way. Only the optimizer's param groups
    differ, and they are matched up here (`_experts_among_dense`, `_experts_apart`)."""
    saved = meta.get("experts")
    if saved is not None and engine.experts is not None:
        groups = len({bucket.group for bucket in engine.experts.buckets})
        if saved["groups"] != groups:
            raise CheckpointError(f"checkpoint {directory} has {saved['groups']} expert param group(s), this "
                                  f"engine's experts have {groups}")
        return meta, records
    if saved is not None and engine.trains:
        return _experts_among_dense(engine, meta, records, directory)
    if engine.experts is not None:
        return _experts_apart(engine, meta, records, directory)
    return meta, records


def _experts_among_dense(engine: EngineProtocol, meta: dict, records: list[dict],
                         directory: Path) -> tuple[dict, list[dict]]:
    """Saved with the experts apart (ep_size > 1), loaded with them among the dense
    parameters (ep_size 1). This engine's param groups are either the saved dense ones
    with the experts inside them (the same count: a group's scalar state, its step count,
    is the experts' too, as both stepped together), or the saved dense groups followed by
    the expert groups (DeepSpeed's `split_params_into_different_moe_groups_for_optimizer`):
    the expert groups' settings and scalar state are appended to the dense ones."""
    saved = meta["experts"]
    dense = len(meta["optimizer"]["param_groups"])
    here = len(engine.optimizer.optimizer.param_groups)
    if saved["optimizer"]["class"] != meta["optimizer"]["class"]:
        raise CheckpointError(f"checkpoint {directory} trained its experts with {saved['optimizer']['class']} and "
                              f"the rest with {meta['optimizer']['class']}; one optimizer cannot take both")
    if here == dense:
        return meta, records
    if here != dense + saved["groups"]:
        raise CheckpointError(f"checkpoint {directory} trained its experts apart (ep_size {saved['layout']['ep_sizes']}) "
                              f"in {saved['groups']} param group(s) beside {dense} dense one(s); this engine (every "
                              f"expert on every rank) has {here} param groups: give it the same dense groups, with "
                              "the experts inside them or in groups of their own after them")
    hyper: dict[int, dict] = {}
    for group, values in zip(saved["bucket_groups"], saved["optimizer"]["param_groups"]):
        hyper.setdefault(group, values)
    meta = {**meta, "optimizer": {**meta["optimizer"], "param_groups": meta["optimizer"]["param_groups"]
                                  + [hyper[group] for group in range(saved["groups"])]},
            "lr_scheduler": _joined_schedules(meta["lr_scheduler"], saved["lr_scheduler"], dense,
                                              len(saved["bucket_groups"]))}
    records = [{**record, "optimizer_groups": {
        **record["optimizer_groups"],
        **{str(dense + int(group)): state for group, state in record.get("experts", {}).get("groups", {}).items()},
    }} for record in records]
    return meta, records


def _experts_apart(engine: EngineProtocol, meta: dict, records: list[dict],
                   directory: Path) -> tuple[dict, list[dict]]:
    """Saved with every expert among the dense parameters (ep_size 1), loaded with the
    experts apart (ep_size > 1): the saved groups are this engine's dense groups followed
    by its expert groups (DeepSpeed's split), or one group that held everything (its
    settings, scalar state and schedule become every expert group's)."""
    experts = engine.experts
    count = len({bucket.group for bucket in experts.buckets})
    dense = len(engine.optimizer.optimizer.param_groups)
    saved_groups = meta["optimizer"]["param_groups"]
    schedule = meta["lr_scheduler"]
    if len(saved_groups) == dense + count:
        source = {group: dense + group for group in range(count)}
        schedule = _schedule_part(meta["lr_scheduler"], slice(0, dense), dense + count)
        expert_schedule = _schedule_part(meta["lr_scheduler"], slice(dense, None), dense + count)
    elif len(saved_groups) == dense == 1:
        source = {group: 0 for group in range(count)}
        expert_schedule = _schedule_part(meta["lr_scheduler"], [0] * len(experts.buckets), 1)
    else:
        raise CheckpointError(f"checkpoint {directory} was saved with every expert among {len(saved_groups)} param "
                              f"group(s); this engine trains its experts apart (ep_size > 1) in {count} group(s) "
                              f"beside {dense} dense one(s): save with the experts in groups of their own after the "
                              "dense ones, or with one group for everything")
    if count != len(experts.buckets):
        expert_schedule = _schedule_part(expert_schedule, [bucket.group for bucket in experts.buckets], count)
    meta = {**meta, "optimizer": {**meta["optimizer"], "param_groups": saved_groups[:dense]}, "lr_scheduler": schedule,
            "experts": {"layout": {"world_size": len(records), "ep_sizes": [1]}, "groups": count,
                        "bucket_groups": [bucket.group for bucket in experts.buckets],
                        "optimizer": {"class": meta["optimizer"]["class"],
                                      "param_groups": [saved_groups[source[bucket.group]]
                                                       for bucket in experts.buckets]},
                        "lr_scheduler": expert_schedule}}
    records = [{**record, "experts": {"groups": {
        str(group): record["optimizer_groups"][str(origin)] for group, origin in source.items()
        if str(origin) in record["optimizer_groups"]}}} for record in records]
    return meta, records


def _joined_schedules(dense: Any, experts: Any, dense_groups: int, expert_groups: int) -> Any:
    """The dense schedule's saved state with the experts' per-group lists (base rates,
    last rates...) after its own: the schedule of one optimizer holding both."""
    if dense is None or experts is None:
        return dense
    values = dict(dense["dict"])
    for key, value in experts["dict"].items():
        mine = values.get(key)
        if isinstance(value, list) and isinstance(mine, list) and (len(mine), len(value)) == (dense_groups,
                                                                                              expert_groups):
            values[key] = mine + value
    return {"dict": values}


def _schedule_part(state: Any, groups: slice | list[int], total: int) -> Any:
    """A saved schedule's state for some of its `total` param groups (a slice of them, or
    a list of positions, repeated as needed)."""
    if state is None:
        return None
    def part(value: Any) -> Any:
        if not (isinstance(value, list) and len(value) == total):
            return value
        return value[groups] if isinstance(groups, slice) else [value[index] for index in groups]
    return {"dict": {key: part(value) for key, value in state["dict"].items()}}


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
                param = bucket.params[param_index][1]
                place = experts.global_places[id(param)]
                for low, high, position in _global_runs(place, param, start, stop):
                    first, width = at + position, high - low
                    index.read_into(place.name, VALUE, low, master[first : first + width])
                    for key, tensor in parts.items():
                        index.read_into(place.name, key, low, tensor[first : first + width])
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
