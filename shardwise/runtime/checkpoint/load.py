"""`engine.load_checkpoint`: resume from a checkpoint written at any world size and stage.

Each rank reads the element ranges it owns *now* (pieces.py), from whichever saved
pieces hold them (index.py), straight into its fp32 master chunk and into freshly built
per-element optimizer state, so the optimizer state is re-partitioned rather than lost.
The torch optimizer's state is then installed through its own `load_state_dict`, which
applies torch's rules for each state's device and dtype (e.g. where `step` lives for
fused or capturable Adam). Finally the live parameters are refreshed from the masters:
the low-precision copy is rewritten and the updated chunks are all-gathered, as after a
step.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import torch
import torch.distributed as dist

from shardwise.runtime.checkpoint.format import (
    FORMAT_VERSION,
    META,
    VALUE,
    CheckpointError,
    rank_json,
    read_json,
)
from shardwise.runtime.checkpoint.expert_state import align_expert_layout, load_experts
from shardwise.runtime.checkpoint.index import PieceIndex
from shardwise.runtime.checkpoint.manifest import check_file, read_manifest, resolve_tag
from shardwise.runtime.checkpoint.pieces import describe_whole_model, module_extras, owned_runs, tensor_shards
from shardwise.runtime.checkpoint.safetensors_io import DTYPES
from shardwise.runtime.checkpoint.state import decode_value, restore_rng_state
from shardwise.runtime.checkpoint.zenflow_state import load_zenflow
from shardwise.runtime.engine_protocol import EngineProtocol

log = logging.getLogger("shardwise")


@dataclass
class OpenedCheckpoint:
    """A checkpoint ready to restore: its meta and rank records as save.py writes them, and
    the index its pieces are read through. `open_checkpoint` opens shardwise's own; a front
    end reading another format (DeepSpeed's) builds one from that format's files."""

    directory: Path
    meta: dict
    records: list[dict]
    index: PieceIndex


def open_checkpoint(engine: EngineProtocol, load_dir: str | os.PathLike, tag: str | None = None) -> OpenedCheckpoint:
    """shardwise's checkpoint `load_dir/tag` (None: the one `latest` names), every file
    verified against its manifest first. Collective."""
    directory = resolve_tag(Path(load_dir), tag)
    verify_checkpoint(engine, directory)
    meta = read_json(directory / META)
    if meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{directory / META} has format {meta.get('format')!r}; "
                              f"this shardwise reads format {FORMAT_VERSION}")
    records = [read_json(directory / rank_json(rank)) for rank in range(meta["world_size"])]
    return OpenedCheckpoint(directory, meta, records, PieceIndex(directory, records))


def load_checkpoint(engine: EngineProtocol, load_dir: str | os.PathLike, tag: str | None = None, *,
                    optimizer_states: bool = True, module_only: bool = False, strict: bool = True,
                    opened: OpenedCheckpoint | None = None) -> dict:
    """Restore everything `save_checkpoint` wrote (tag None: the one `latest` names) and
    return the saved client_state. Collective: every rank calls it. `opened`: restore that
    checkpoint instead (another format's, opened by its front end; `load_dir` and `tag`
    are then not read).

    The loader a front end gave the engine (`engine.data_position`) resumes where the
    saved one stood, at any data-parallel size; a checkpoint without a data position
    leaves it where it is. Ranks beyond the saved world size keep their own RNG state; the others get theirs back
    (a checkpoint whose records hold no RNG state leaves every rank's as it is).
    `optimizer_states` False restores the weights (the fp32 masters) but keeps this
    engine's optimizer state; `module_only` also keeps its schedule, counters, loss scale
    and random state: a fine-tuning run that starts from a trained model (DeepSpeed's
    `load_optimizer_states=False` and `load_module_only=True`).

    `strict` False (DeepSpeed's `load_module_strict=False`, torch's `strict=False`): the
    model's tensors the checkpoint lacks keep their current values and the checkpoint's
    tensors the model lacks are skipped, both named in a warning; a shape that differs
    is still an error. The optimizer state then cannot be restored whole (the new
    tensors would share a step count they never took), so a load that lacks any of the
    model's trained parameters must keep this engine's state (`optimizer_states` False).

    An engine without an optimizer takes the weights only (as `module_only`), into the
    parameters it holds.
    """
    opened = opened if opened is not None else open_checkpoint(engine, load_dir, tag)
    meta, records = opened.meta, opened.records
    with opened.index as index:
        module_only = module_only or not engine.trains  # an engine without an optimizer takes the weights
        meta, records = align_expert_layout(engine, meta, records, opened.directory)
        absent = check_model(engine, meta, index, strict=strict, restoring_state=optimizer_states and not module_only)
        engine.zero.release_gathered()  # forwards must gather the loaded values
        engine.zero.await_readers()  # shards shared in memory: no peer still reads the old values
        if engine.trains:
            _load_trained(engine, index, meta, records, optimizer_states=optimizer_states and not module_only,
                          absent=absent)
        with torch.no_grad():
            for name, tensor in module_extras(engine):
                if name in absent:
                    continue
                tensor.copy_(index.read(name, VALUE, 0, tensor.numel(), tensor.dtype).view(tensor.shape))
            shards = tensor_shards(engine.module)
            for name, low, high, values in engine.zero.untrained_pieces():  # into this rank's shards (stage 3)
                if name in absent:
                    continue
                for start, stop, at in owned_runs(low, high, shards.get(name)):
                    index.read_into(name, VALUE, start, values[at : at + stop - start])
        if engine.experts is not None:
            load_experts(engine, index, meta, records, optimizer_states=optimizer_states and not module_only,
                         schedule=not module_only)
    engine.zero.refresh_from_masters()
    if module_only:
        return meta["client_state"]
    if engine.zenflow is not None:
        load_zenflow(engine, opened.directory, meta, records)

    if engine.lr_scheduler is not None and meta["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(decode_value(meta["lr_scheduler"]))
    if engine.loss_scaler.dynamic and meta["loss_scaler"] is not None:
        engine.loss_scaler.load_state_dict(meta["loss_scaler"])
    counters = meta["counters"]
    engine.global_steps = counters["global_steps"]
    engine.micro_steps = _first_micro_step(engine, counters)
    engine.skipped_steps = counters["skipped_steps"]
    if meta.get("data_position") is not None:
        if engine.data_position is not None:
            engine.data_position.load_state_dict(meta["data_position"])
        else:  # loaded at construction (auto-resume): the front end's loader comes after
            engine.pending_data_position = meta["data_position"]
    if engine.random_ltd is not None and meta.get("random_ltd") is not None:
        engine.random_ltd.load_state_dict(meta["random_ltd"])
    if engine.rank < len(records) and "rng" in records[engine.rank]:
        restore_rng_state(records[engine.rank]["rng"], engine.device)
    return meta["client_state"]


def _first_micro_step(engine: EngineProtocol, counters: dict) -> int:
    """Resume at the start of an accumulation window of the *current* accumulation: a
    world size that changes `gradient_accumulation_steps` for the same global batch would
    otherwise put the window boundaries where the saved run had them, and the first
    update would apply a partial window. A checkpoint saved inside a window holds none of
    that window's gradients: its micro-batches are run again, which is said once."""
    saved_accumulation = counters.get("gradient_accumulation_steps")
    into_window = counters["micro_steps"] % saved_accumulation if saved_accumulation else 0
    if into_window and engine.rank == 0:
        log.warning("shardwise: the checkpoint was saved %d micro-batch(es) into an accumulation window; "
                    "their gradients are not in it, so training resumes at the start of that window",
                    into_window)
    return engine.global_steps * engine.gradient_accumulation_steps


def verify_checkpoint(engine: EngineProtocol, directory: Path) -> None:
    """Check every file against the manifest before anything is read. The files are
    split over the ranks; the first failure (by file order) is reported on every rank."""
    files = read_manifest(directory)
    names = sorted(files)
    first_bad = len(names)
    for position in range(engine.rank, len(names), engine.world_size):
        if check_file(directory, names[position], files[names[position]]) is not None:
            first_bad = position
            break
    flag = torch.tensor([first_bad], dtype=torch.int64, device=engine.device)
    engine.world.control_all_reduce(flag, "checkpoint verification", op=dist.ReduceOp.MIN)
    if flag.item() < len(names):
        name = names[flag.item()]
        raise CheckpointError(check_file(directory, name, files[name]) or f"checkpoint file "
                              f"{directory / name} failed verification on another rank")


def check_model(engine: EngineProtocol, meta: dict, index: PieceIndex, *, strict: bool = True,
                restoring_state: bool = False) -> set[str]:
    """The checkpoint holds exactly the model's parameters and buffers, with its shapes
    (`strict` False: a subset or superset of them, with its shapes, and when
    `restoring_state` every trained parameter). Returns the names of the model's tensors
    the checkpoint does not hold."""
    saved = {entry["name"]: entry for entry in meta["parameters"] + meta["buffers"]}
    current = describe_whole_model(engine)
    wanted = [("parameter", entry) for entry in current["parameters"]]
    wanted += [("buffer", entry) for entry in current["buffers"]]
    absent = {entry["name"] for _, entry in wanted if entry["name"] not in saved}
    known = {entry["name"] for _, entry in wanted}
    unknown = [name for name in saved if name not in known]
    if not strict:
        trained_absent = sorted(entry["name"] for entry in current["parameters"]
                                if entry["trainable"] and entry["name"] in absent)
        if trained_absent and restoring_state:
            raise CheckpointError(f"checkpoint {index.directory} lacks the model's trained parameter "
                                  f"{trained_absent[0]}, so the optimizer state cannot be restored with it: "
                                  "load the weights only (load_optimizer_states=False)")
        if (absent or unknown) and engine.rank == 0:
            log.warning("load_checkpoint(strict=False): %d tensor(s) of the model not in the checkpoint keep their "
                        "values %s; %d tensor(s) of the checkpoint not in the model are skipped %s",
                        len(absent), sorted(absent)[:5], len(unknown), unknown[:5])
        wanted = [(kind, entry) for kind, entry in wanted if entry["name"] not in absent]
        unknown = []
    for kind, entry in wanted:
        shape = tuple(entry["shape"])
        if entry["name"] not in saved:
            excluded = ("; it was saved with exclude_frozen_parameters=True, without the parameters nothing "
                        "trains: load it with strict=False (DeepSpeed's load_module_strict=False), which keeps "
                        "the model's own values for them" if meta.get("frozen_parameters_excluded") else "")
            raise CheckpointError(f"the model's {kind} {entry['name']} (shape {shape}) is not in "
                                  f"checkpoint {index.directory}{excluded}")
        saved_shape = tuple(saved[entry["name"]]["shape"])
        if saved_shape != shape:
            raise CheckpointError(f"{kind} {entry['name']} has shape {saved_shape} in checkpoint "
                                  f"{index.directory} but shape {shape} in the model")
    if unknown:
        raise CheckpointError(f"checkpoint {index.directory} holds {unknown[0]} (shape "
                              f"{tuple(saved[unknown[0]]['shape'])}), which the model does not have")
    for _, entry in wanted:
        index.check_complete(entry["name"], math.prod(entry["shape"]))
    if not engine.trains:
        return absent
    saved_class = meta["optimizer"]["class"]
    optimizer = engine.optimizer.optimizer
    if saved_class != type(optimizer).__name__:
        raise CheckpointError(f"checkpoint {index.directory} was trained with {saved_class}, "
                              f"this engine uses {type(optimizer).__name__}")
    saved_groups = len(meta["optimizer"]["param_groups"])
    if saved_groups != len(optimizer.param_groups):
        raise CheckpointError(f"checkpoint {index.directory} has {saved_groups} optimizer param "
                              f"groups, this engine's optimizer has {len(optimizer.param_groups)}")
    return absent


def _load_trained(engine: EngineProtocol, index: PieceIndex, meta: dict, records: list[dict], *,
                  optimizer_states: bool, absent: set[str]) -> None:
    """Fill the owned masters (but those of `absent` parameters) and (`optimizer_states`)
    build the optimizer state of every owned segment."""
    scalars, elements = _group_states(records) if optimizer_states else ({}, {})
    if optimizer_states:
        engine.optimizer.optimizer.state.clear()  # loading into a trained engine: not two copies
    parts: dict[int, dict[str, torch.Tensor]] = {}
    for segment in engine.optimizer.segments:
        group = str(segment.group)
        if group in scalars:
            parts[id(segment)] = {
                key: torch.zeros(segment.numel, dtype=DTYPES[dtype], device=segment.master.device)
                for key, dtype in elements[group].items()
            }
    shards = tensor_shards(engine.module)
    for owned_in_group in engine.zero.owned_ranges_by_sub_group():  # a paging store writes the masters back
        for owned in owned_in_group:
            if owned.name in absent:
                continue
            for start, stop, at in owned_runs(owned.start, owned.stop, shards.get(owned.name)):
                index.read_into(owned.name, VALUE, start, owned.master[at : at + stop - start])
                for key, tensor in parts.get(id(owned.segment), {}).items():
                    index.read_into(owned.name, key, start, owned.state_view(tensor)[at : at + stop - start])
    if not optimizer_states:
        return
    codec = engine.zero.codec
    states = {
        id(segment): codec.decode(parts[id(segment)], {
            key: decode_value(value) for key, value in scalars[str(segment.group)].items()})
        for segment in engine.optimizer.segments if id(segment) in parts
    }

    optimizer = engine.optimizer.optimizer
    position = {id(p): i for i, p in enumerate(chain.from_iterable(g["params"] for g in optimizer.param_groups))}
    groups = []
    for group, saved in zip(optimizer.param_groups, meta["optimizer"]["param_groups"]):
        hyper = {key: value for key, value in group.items() if key != "params"}
        hyper.update({key: decode_value(value) for key, value in saved.items()})
        groups.append({**hyper, "params": [position[id(p)] for p in group["params"]]})
    optimizer.load_state_dict({
        "state": {position[id(s.master)]: states[id(s)] for s in engine.optimizer.segments if id(s) in states},
        "param_groups": groups,
    })
    engine.zero.adopt_optimizer_state()  # a paging store moves the new state into its pages


def _group_states(records: list[dict]) -> tuple[dict[str, dict], dict[str, dict]]:
    """Per param group: scalar state and per-element state dtypes (from any rank that
    trained part of the group; they agree)."""
    scalars: dict[str, dict] = {}
    elements: dict[str, dict] = {}
    for record in records:
        for group, state in record["optimizer_groups"].items():
            scalars.setdefault(group, state["scalars"])
            elements.setdefault(group, state["elements"])
    return scalars, elements


