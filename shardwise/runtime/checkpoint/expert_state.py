"""The experts of expert-parallel layers in a checkpoint (runtime/parallel/expert/).

Experts train apart from ZeRO's stores (parallel/expert/training.py): each rank holds
whole parameters of its 1/P of a layer's experts, under the layer's *local* names
(`deepspeed_experts.0 .. E/P - 1`), and a torch optimizer of their own over one slice of
each bucket (a param group's experts of one size; at ZeRO >= 1 the rank's 1/N of it).
Their values and the optimizer's per-element states go into the rank's own tensor file
(so the manifest checks them like every piece), as `experts/<name>/value` (the compute dtype),
`experts/<bucket>/<state>` and, in bf16 training, `experts/<bucket>/master` (fp32); the rank's JSON record lists the names and each bucket's
scalar state; the meta holds the layout, the experts' param groups and their schedule.

Local names mean different experts on different ranks, so a checkpoint resumes at the
layout that saved it (the same world size, data-parallel size and expert-parallel
sizes): every rank reads back its own experts. Regrouping the experts at another layout
is refused with that reason rather than loading experts into the wrong places.
"""

from __future__ import annotations

from typing import Any

import torch

from shardwise.runtime.checkpoint.format import CheckpointError
from shardwise.runtime.checkpoint.safetensors_io import SafetensorsReader
from shardwise.runtime.checkpoint.state import decode_value, encode_value
from shardwise.runtime.engine_protocol import EngineProtocol

def expert_key(name: str, what: str) -> str:
    return f"experts/{name}/{what}"


def expert_layout(engine: EngineProtocol) -> dict[str, Any] | None:
    """What decides which experts a rank holds: a checkpoint resumes only where it agrees."""
    if engine.experts is None:
        return None
    return {"world_size": engine.world_size, "data_size": engine.mesh.data_size,
            "ep_sizes": sorted({size for _, _, size in engine.experts.params}),
            "partitioned": engine.experts.partitioned, "dtype": str(engine.dtype).removeprefix("torch.")}


def expert_meta(engine: EngineProtocol) -> dict[str, Any] | None:
    """The meta's `experts` entry: layout, param groups' hyper-parameters, schedule."""
    if engine.experts is None:
        return None
    optimizer, scheduler = engine.experts.optimizer, engine.expert_lr_scheduler
    return {
        "layout": expert_layout(engine),
        "optimizer": {
            "class": type(optimizer).__name__,
            "param_groups": [
                {key: encode_value(value, f"expert param group {index} {key!r}")
                 for key, value in group.items() if key not in ("params", "param_names")}
                for index, group in enumerate(optimizer.param_groups)
            ],
        },
        "lr_scheduler": None if scheduler is None else encode_value(scheduler.state_dict(),
                                                                   "expert lr scheduler state"),
    }


def expert_share(engine: EngineProtocol) -> tuple[list[tuple[str, torch.Tensor]], dict[str, Any]]:
    """This rank's expert tensors (key, flat view of the live tensor) and its record: the
    parameter names in training order and, per bucket (parallel/expert/training.py), the
    optimizer's scalar state and the names of its per-element states, which cover the
    bucket's slice (this rank's 1/N of its buffer when partitioned)."""
    experts = engine.experts
    tensors = [(expert_key(name, "value"), param.detach().reshape(-1)) for name, param, _ in experts.params]
    buckets = {}
    for bucket in experts.buckets:
        scalars, elements = {}, []
        for key, value in experts.optimizer.state.get(bucket.master, {}).items():
            if torch.is_tensor(value) and value.dim() > 0:
                if value.shape != bucket.master.shape:
                    raise CheckpointError(f"optimizer state {key!r} of the experts {bucket.name} has shape "
                                          f"{tuple(value.shape)}, not their slice's {tuple(bucket.master.shape)}; "
                                          "checkpoints store per-element state and scalars")
                tensors.append((expert_key(bucket.name, key), value.detach().reshape(-1)))
                elements.append(key)
            else:
                scalars[key] = encode_value(value, f"optimizer state {key!r} of the experts {bucket.name}")
        if bucket.master.data_ptr() != bucket.slice.data_ptr():  # bf16: the fp32 master is a copy
            tensors.append((expert_key(bucket.name, "master"), bucket.master.detach()))
        buckets[bucket.name] = {"scalars": scalars, "elements": elements}
    return tensors, {"names": [name for name, _, _ in experts.params], "buckets": buckets}


def check_expert_layout(engine: EngineProtocol, meta: dict, directory: Any) -> None:
    """Refuse, before anything is read, a checkpoint whose experts would land elsewhere."""
    saved = meta.get("experts")
    current = expert_layout(engine)
    if saved is None and current is None:
        return
    if saved is None:
        raise CheckpointError(f"checkpoint {directory} was saved without expert parallelism (ep_size 1, or by "
                              f"another format), and this engine trains experts at ep_size {current['ep_sizes']}: "
                              "resume it with ep_size 1")
    if current is None:
        raise CheckpointError(f"checkpoint {directory} holds the experts of expert-parallel layers (ep_size "
                              f"{saved['layout']['ep_sizes']}, each rank its own) and this engine trains none: "
                              "resume at the saving ep_size and world size")
    if saved["layout"] != current:
        raise CheckpointError(f"checkpoint {directory} was saved with experts laid out as {saved['layout']}, and "
                              f"this engine lays them out as {current}: each rank saved its own experts under local "
                              "names, and regrouping them at another world size or ep_size is not supported; "
                              "resume at the saving world size and ep_size")


def load_experts(engine: EngineProtocol, meta: dict, record: dict, reader: SafetensorsReader, *,
                 optimizer_states: bool, schedule: bool) -> None:
    """Restore this rank's experts from its own record and tensor file (`optimizer_states`:
    their optimizer state and hyper-parameters too; `schedule`: their lr schedule)."""
    experts = engine.experts
    names = [name for name, _, _ in experts.params]
    if record["names"] != names:
        raise CheckpointError(f"rank {engine.rank} saved experts {record['names'][:4]}..., this rank trains "
                              f"{names[:4]}...: the models differ")
    with torch.no_grad():
        for name, param, _ in experts.params:
            param.copy_(reader.read(expert_key(name, "value"), 0, param.numel()).view(param.shape))
        for bucket in experts.buckets:
            if bucket.master.data_ptr() != bucket.slice.data_ptr():
                bucket.master.copy_(reader.read(expert_key(bucket.name, "master"), 0, bucket.master.numel()))
    saved = meta["experts"]
    if optimizer_states:
        optimizer = experts.optimizer
        if saved["optimizer"]["class"] != type(optimizer).__name__:
            raise CheckpointError(f"the experts were trained with {saved['optimizer']['class']}, this engine "
                                  f"trains them with {type(optimizer).__name__}")
        if len(saved["optimizer"]["param_groups"]) != len(optimizer.param_groups):
            raise CheckpointError(f"the experts' optimizer had {len(saved['optimizer']['param_groups'])} param "
                                  f"groups, this engine's has {len(optimizer.param_groups)}")
        state, groups = {}, []
        for position, (group, hyper) in enumerate(zip(optimizer.param_groups, saved["optimizer"]["param_groups"])):
            (master,) = group["params"]
            bucket = next(bucket for bucket in experts.buckets if bucket.master is master)
            stored = record["buckets"][bucket.name]
            entry = {key: decode_value(value) for key, value in stored["scalars"].items()}
            for what in stored["elements"]:
                entry[what] = reader.read(expert_key(bucket.name, what), 0, master.numel()).view(master.shape)
            if entry:
                state[position] = entry
            kept = {key: value for key, value in group.items() if key != "params"}
            kept.update({key: decode_value(value) for key, value in hyper.items()})
            groups.append({**kept, "params": [position]})
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    if schedule and engine.expert_lr_scheduler is not None and saved["lr_scheduler"] is not None:
        engine.expert_lr_scheduler.load_state_dict(decode_value(saved["lr_scheduler"]))
