"""What a rank owns, named the way a checkpoint stores it: parameter name + element range
(zero/shard_view.py), and the model's description a loader checks against.

Saving walks the owned ranges and writes the views they carry; loading walks the new
owner's ranges and fills them. The engine is reached through its protocol
(runtime/engine_protocol.py), its ZeRO side through ZeroState's.
"""

from __future__ import annotations

from typing import Any

import torch

from shardwise.runtime.checkpoint.expert_state import describe_experts
from shardwise.runtime.distributed.collectives import mesh_communicator
from shardwise.runtime.engine_protocol import EngineProtocol
from shardwise.runtime.parallel.tensor.placement import TensorShard, tensor_shard


def module_extras(engine: EngineProtocol, frozen: bool = True) -> list[tuple[str, torch.Tensor]]:
    """Frozen parameters that ZeRO does not hold (all of them at stages 0-2, those under
    the persistence threshold at stage 3; `frozen` False: none) and persistent buffers
    (BatchNorm statistics...): whole on every rank, written by rank 0. Non-persistent
    buffers (rotary tables, causal masks) are rebuilt by the model and, as in
    `state_dict()`, not saved."""
    module = engine.module
    held = {id(slot.param) for unit in engine.zero.frozen_units for slot in unit.slots}
    persistent = set(module.state_dict(keep_vars=True))
    extras = [(name, param) for name, param in module.named_parameters()
              if frozen and not param.requires_grad and id(param) not in held]
    extras += [(name, buffer) for name, buffer in module.named_buffers() if name in persistent]
    return extras


def tensor_shards(module: torch.nn.Module) -> dict[str, TensorShard]:
    """The tensor-parallel placement of every sharded parameter, by name."""
    shards = {}
    for name, param in module.named_parameters():
        shard = tensor_shard(param)
        if shard is not None:
            shards[name] = shard
    return shards


def owned_runs(start: int, stop: int, shard: TensorShard | None) -> list[tuple[int, int, int]]:
    """An owned range [start, stop) of the local tensor in the whole parameter's flat
    coordinates: (global start, global stop, position inside the owned range) runs. A
    tensor-parallel rank's local block is not one range of the whole parameter; its
    placement (`TensorShard`) maps it, so every piece a checkpoint stores names elements of
    the whole parameter, whatever the tensor, data or pipeline sizes that save or load it."""
    if shard is None:
        return [(start, stop, 0)]
    return shard.global_runs(start, stop)


def strided_pieces(runs: list[tuple[int, int, int]]) -> list[tuple[int, int, int, int, int]]:
    """Runs (global start, global stop, position) grouped into pieces (start, run, stride,
    count, position): consecutive runs of one length at one stride, stored back to back,
    become one piece (a row-parallel block: all its rows; fused q/k/v split along Conv1D's
    columns: its three ranges of every row)."""
    pieces: list[tuple[int, int, int, int, int]] = []
    for low, high, at in runs:
        if pieces:
            start, run, stride, count, first = pieces[-1]
            step = low - start if count == 1 else stride
            if high - low == run and at == first + run * count and low == start + step * count and step >= run:
                pieces[-1] = (start, run, step, count + 1, first)
                continue
        pieces.append((low, high - low, high - low, 1, at))
    return pieces


def describe_tensor_parallel(engine: EngineProtocol) -> dict[str, Any] | None:
    """How the saving run split each parameter (for the reader; loading needs only the
    pieces, which are in whole-parameter coordinates)."""
    size = engine.mesh["tensor"].size
    if size == 1:
        return None
    split = {name: {"dim": shard.dim, "global_shape": list(shard.global_shape), "blocks": len(shard.ranges)}
             for name, shard in tensor_shards(engine.module).items()}
    return {"size": size, "split": split}


def describe_model(engine: EngineProtocol) -> dict[str, Any]:
    """Names and shapes the loader checks a model against (stage-3 parameters are empty
    placeholders between forwards, so trained shapes come from the layout; a
    tensor-parallel parameter is described by its whole shape), and the optimizer param
    group of each trained one (a converter to another layout, DeepSpeed's, needs it)."""
    trained = {slot.name: list(slot.shape) for unit in engine.zero.units for slot in unit.slots}
    held_frozen = {slot.name: list(slot.shape) for unit in engine.zero.frozen_units for slot in unit.slots}
    shapes = {**trained, **held_frozen}
    shapes.update({name: list(shard.global_shape) for name, shard in tensor_shards(engine.module).items()
                   if name in shapes})
    module = engine.module
    experts = {id(param) for _, param, _ in engine.experts.params} if engine.experts is not None else set()
    groups = {slot.name: slot.group for unit in engine.zero.units for slot in unit.slots} if engine.trains else {}
    parameters = [  # dtype: of the stored values (fp32 masters for trained parameters); group: its param group
        {"name": name, "shape": shapes.get(name, list(param.shape)), "trainable": name in trained,
         "dtype": "float32" if name in trained else _dtype_name(param.dtype),
         **({"group": groups[name]} if name in groups else {})}
        for name, param in module.named_parameters()
        if id(param) not in experts  # under their every-expert names (describe_whole_model)
    ]
    persistent = set(module.state_dict(keep_vars=True))
    buffers = [
        {"name": name, "shape": list(buffer.shape), "dtype": _dtype_name(buffer.dtype)}
        for name, buffer in module.named_buffers()
        if name in persistent
    ]
    canonical = {id(param): name for name, param in module.named_parameters()}
    aliases = {
        name: canonical[id(param)]
        for name, param in module.named_parameters(remove_duplicate=False)
        if canonical[id(param)] != name
    }
    return {"parameters": parameters, "buffers": buffers, "aliases": aliases}


def describe_whole_model(engine: EngineProtocol) -> dict[str, Any]:
    """`describe_model` of the whole model: with pipeline parallelism each rank holds only
    its stage's parameters, so the stages' descriptions are merged, in stage order
    (collective over the pipeline group). A checkpoint then names every parameter,
    whatever pipeline size saves or loads it. Experts trained apart (ep_size > 1) are
    gathered from every rank, under their names in the every-expert model (collective)."""
    description = describe_model(engine)
    if engine.experts is not None:  # each rank holds some experts: every rank's, under every-expert names
        known: set[str] = set()
        for part in engine.world.control_all_gather_object(describe_experts(engine)):
            description["parameters"] += [entry for entry in part if entry["name"] not in known]
            known.update(entry["name"] for entry in part)
    if engine.mesh["pipeline"].size == 1:
        return description
    merged: dict[str, Any] = {"parameters": [], "buffers": [], "aliases": {}}
    seen: set[str] = set()
    for part in mesh_communicator(engine.mesh, "pipeline").control_all_gather_object(description):
        for key in ("parameters", "buffers"):
            merged[key] += [entry for entry in part[key] if entry["name"] not in seen]
            seen.update(entry["name"] for entry in part[key])
        merged["aliases"].update(part["aliases"])
    return merged


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
