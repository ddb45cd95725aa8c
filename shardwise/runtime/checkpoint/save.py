"""`engine.save_checkpoint`: every rank writes what it owns; rank 0 publishes.

A rank's share is written straight from the buffers it trains with (fp32 master pieces
and the matching slices of every per-element optimizer state, as the optimizer's codec
gives them), named by parameter and element range, so no rank ever holds more of the
model than it already did. Where shards are replicated (stage 0, where every rank owns
everything, and hybrid sharding) only the first replica writes model and optimizer data;
frozen parameters and buffers, whole on every rank, are written once, by rank 0. Every
rank writes its own RNG state.

Failures are agreed on: after each phase the ranks all-reduce a success flag, so a full
disk on one rank makes every rank raise instead of leaving its peers blocked in a
collective until they time out.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from shardwise.runtime.checkpoint.format import (
    FORMAT_VERSION,
    META,
    VALUE,
    CheckpointError,
    check_tag,
    piece_key,
    rank_json,
    rank_tensors,
    read_json,
    staging_dir,
)
from shardwise.runtime.checkpoint.manifest import file_digest, publish, write_manifest, write_synced
from shardwise.runtime.checkpoint.pieces import (
    describe_tensor_parallel,
    describe_whole_model,
    module_extras,
    owned_runs,
    strided_pieces,
    tensor_shards,
)
from shardwise.runtime.checkpoint.safetensors_io import SafetensorsWriter, TensorEntry, dtype_name
from shardwise.runtime.checkpoint.state import capture_rng_state, check_json, encode_value
from shardwise.runtime.checkpoint.zenflow_state import save_zenflow
from shardwise.runtime.engine_protocol import EngineProtocol


def save_checkpoint(
    engine: EngineProtocol, save_dir: str | os.PathLike, tag: str | None = None, client_state: dict | None = None
) -> str:
    """Write a checkpoint of `engine` under `save_dir/tag` (default tag: global_step<N>) and
    point `save_dir/latest` at it. Collective: every rank calls it. Returns the tag.

    `client_state` (rank 0's is kept) must be JSON: str keys; tuples come back as lists.
    """
    if not engine.trains:
        raise RuntimeError("save_checkpoint: this engine was given no optimizer (forward only), so it has no "
                           "training state to resume; write its weights with engine.save_16bit_model(dir)")
    tag = f"global_step{engine.global_steps}" if tag is None else tag
    check_tag(tag)
    client_state = {} if client_state is None else client_state
    root = Path(save_dir)
    staging = staging_dir(root, tag)

    def prepare() -> None:
        check_json(client_state)
        if engine.rank == 0:
            try:
                root.mkdir(parents=True, exist_ok=True)
                _remove_leftovers(root)
                staging.mkdir()
            except OSError as error:
                raise CheckpointError(f"cannot create the checkpoint folder {staging}: {error.strerror} "
                                      f"({error.filename}); save into a folder this user can write to (check "
                                      "its permissions, that it is not a file, and that its file system is not "
                                      "mounted read-only)") from error

    model = describe_whole_model(engine)  # collective over a pipeline group, so every rank computes it

    def finish() -> None:
        if engine.rank == 0:
            _write_meta(engine, staging, tag, client_state, model)
            _write_manifest(engine.world_size, staging)
            publish(root, tag)

    _together(engine, prepare, "preparing the checkpoint directory")
    _together(engine, lambda: _write_rank_files(engine, staging), "writing its checkpoint files")
    _together(engine, finish, "publishing the checkpoint")
    return tag


def _remove_leftovers(root: Path) -> None:
    """Partial directories of saves that were killed or failed, whatever their tag: they
    are never loadable (no manifest, never renamed), only taking disk space."""
    for entry in root.glob(".*.partial"):
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)


def _together(engine: EngineProtocol, step: Callable[[], None], what: str) -> None:
    """Run `step` on every rank; if any rank fails, every rank raises."""
    error: BaseException | None = None
    try:
        step()
    except Exception as caught:  # re-raised below, after the peers know
        error = caught
    flag = torch.tensor([0 if error is not None else 1], device=engine.device)
    engine.world.control_all_reduce(flag, f"checkpoint: {what}", op=dist.ReduceOp.MIN)  # every rank, all groups
    if flag.item() == 1:
        return
    failures = engine.world.control_all_gather_object(None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    rank, failure = next((rank, failure) for rank, failure in enumerate(failures) if failure is not None)
    raise CheckpointError(f"rank {engine.rank}: rank {rank} failed while {what}: {failure}")


def _write_rank_files(engine: EngineProtocol, staging: Path) -> None:
    """This rank's pieces (safetensors) and its record (JSON): piece list, optimizer
    scalars per param group, RNG state, and the checksum of its tensor file."""
    zero = engine.zero
    writes_model = zero.writes_model
    zenflow_record = None
    files: dict[str, tuple[int, str]] = {}
    if engine.zenflow is not None:
        engine.zenflow.settle_masters()
        zenflow_record, written = save_zenflow(engine, staging)
        files.update(written)
    element_states, groups = _optimizer_states(engine) if writes_model else ({}, {})
    pieces: list[dict[str, Any]] = []
    tensors: list[tuple[str, torch.Tensor, int]] = []  # key, values, optimizer sub-group (-1: none)

    def add(name: str, start: int, stop: int, named: dict[str, torch.Tensor], sub_group: int,
            run: int = 0, stride: int = 0) -> None:
        entry = {"name": name, "start": start, "stop": stop, "tensors": list(named)}
        pieces.append({**entry, "run": run, "stride": stride} if run else entry)
        tensors.extend((piece_key(name, start, stop, key), tensor, sub_group) for key, tensor in named.items())

    if writes_model:
        shards = tensor_shards(engine.module)
        first_tensor_rank = engine.mesh["tensor"].rank == 0
        for owned in zero.owned_ranges():
            if owned.name not in shards and not first_tensor_rank:
                continue  # replicated over the tensor group: its first rank writes it
            states = element_states.get(id(owned.segment), {})
            named = {VALUE: owned.master, **{key: owned.state_view(state) for key, state in states.items()}}
            runs = owned_runs(owned.start, owned.stop, shards.get(owned.name))
            for start, run, stride, count, at in strided_pieces(runs):
                stored = {key: view[at : at + run * count] for key, view in named.items()}
                stop = start + (count - 1) * stride + run
                add(owned.name, start, stop, stored, zero.sub_group_index(owned.segment),
                    *((run, stride) if count > 1 else ()))
        for name, low, high, values in zero.untrained_pieces():  # stage 3: frozen weights are partitioned too
            if name not in shards and not first_tensor_rank:
                continue
            for start, run, stride, count, at in strided_pieces(owned_runs(low, high, shards.get(name))):
                add(name, start, start + (count - 1) * stride + run, {VALUE: values[at : at + run * count]}, -1,
                    *((run, stride) if count > 1 else ()))
    if engine.rank == 0:
        for name, tensor in module_extras(engine):
            add(name, 0, tensor.numel(), {VALUE: tensor.detach().reshape(-1)}, -1)

    if tensors:
        # sub-group by sub-group: a paging store (NVMe) holds only the one being written
        tensors.sort(key=lambda item: (item[2] < 0, item[2]))  # untrained pieces (-1) last
        path = staging / rank_tensors(engine.rank)
        entries = [TensorEntry(key, tensor.dtype, (tensor.numel(),)) for key, tensor, _ in tensors]
        with SafetensorsWriter(path, entries, metadata={"format": "pt"}) as writer:
            for sub_group, items in itertools.groupby(tensors, key=lambda item: item[2]):
                with zero.resident(sub_group if sub_group >= 0 else None):
                    for key, tensor, _ in items:
                        writer.write(key, tensor)
            files[path.name] = writer.close()
    record = {
        "rank": engine.rank,
        "pieces": pieces,
        "optimizer_groups": groups,
        "rng": capture_rng_state(engine.device),
        "files": files,
    }
    if zenflow_record is not None:
        record["zenflow"] = zenflow_record
    write_synced(staging / rank_json(engine.rank), json.dumps(record))


def _optimizer_states(engine: EngineProtocol) -> tuple[dict[int, dict[str, torch.Tensor]], dict[str, dict]]:
    """Per segment, its per-element state tensors (the codec's `elements`); per param
    group, its scalar state (e.g. Adam's `step`) and the dtypes of its per-element states.

    Scalars are stored per group, not per segment: segments are an artefact of this
    rank's layout, and every segment of a group steps together, so they agree.
    """
    optimizer, codec = engine.optimizer.optimizer, engine.zero.codec
    element_states: dict[int, dict[str, torch.Tensor]] = {}
    groups: dict[str, dict] = {}
    for segment in engine.optimizer.segments:
        state = optimizer.state.get(segment.master, {})
        if not state:
            continue
        elements, raw_scalars = codec.encode(state, segment.numel)
        scalars = {
            key: encode_value(value, f"optimizer state {key!r} of param group {segment.group}")
            for key, value in raw_scalars.items()
        }
        element_states[id(segment)] = elements
        record = {"scalars": scalars, "elements": {key: dtype_name(v.dtype) for key, v in elements.items()}}
        seen = groups.setdefault(str(segment.group), record)
        if seen != record:
            raise CheckpointError(
                f"optimizer state differs between parameters of param group {segment.group} "
                f"({seen} vs {record}); checkpoints keep one scalar state per group"
            )
    return element_states, groups


def _write_meta(engine: EngineProtocol, staging: Path, tag: str, client_state: dict, model: dict) -> None:
    optimizer = engine.optimizer.optimizer
    scheduler = engine.lr_scheduler
    if scheduler is not None and not hasattr(scheduler, "state_dict"):
        raise TypeError(f"the lr scheduler ({type(scheduler).__name__}) has no state_dict() to checkpoint")
    meta = {
        "format": FORMAT_VERSION,
        "tag": tag,
        "world_size": engine.world_size,
        "stage": engine.stage,
        "dtype": str(engine.dtype).removeprefix("torch."),
        **model,
        "optimizer": {
            "class": type(optimizer).__name__,
            "param_groups": [
                {key: encode_value(value, f"param group {index} {key!r}")
                 for key, value in group.items() if key not in ("params", "param_names")}
                for index, group in enumerate(optimizer.param_groups)
            ],
        },
        "lr_scheduler": None if scheduler is None else encode_value(scheduler.state_dict(), "lr scheduler state"),
        "loss_scaler": engine.loss_scaler.state_dict() if engine.loss_scaler.dynamic else None,
        "counters": {
            "global_steps": engine.global_steps,
            "micro_steps": engine.micro_steps,
            "skipped_steps": engine.skipped_steps,
            "gradient_accumulation_steps": engine.gradient_accumulation_steps,
        },
        "client_state": client_state,
        "hf": _hf_description(engine.module),
        "tensor_parallel": describe_tensor_parallel(engine),
    }
    write_synced(staging / META, json.dumps(meta, indent=1))


def _hf_description(module: torch.nn.Module) -> dict | None:
    """A `transformers` model's class and full config, so `convert --hf` can write config.json."""
    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "to_json_string"):
        return None
    return {"class": type(module).__name__, "config": json.loads(config.to_json_string(use_diff=False))}


def _write_manifest(world_size: int, staging: Path) -> None:
    """Tensor files were hashed by their writers as they streamed; JSON files are small."""
    files: dict[str, tuple[int, str]] = {}
    for rank in range(world_size):
        record = read_json(staging / rank_json(rank))
        files.update({name: tuple(entry) for name, entry in record["files"].items()})
        files[rank_json(rank)] = file_digest(staging / rank_json(rank))
    files[META] = file_digest(staging / META)
    write_manifest(staging, files)
