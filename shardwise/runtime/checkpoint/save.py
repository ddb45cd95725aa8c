"""`engine.save_checkpoint`: every rank writes what it owns; rank 0 publishes.

A rank's share is written straight from the buffers it trains with (fp32 master pieces
and the matching slices of every per-element optimizer state, as the optimizer's codec
gives them), named by parameter and element range, so no rank ever holds more of the
model than it already did. Where shards are replicated (stage 0, where every rank owns
everything, and hybrid sharding) only the first replica writes model and optimizer data;
frozen parameters and buffers, whole on every rank, are written once, by rank 0 (with a
pipeline, by each stage's first rank). Every rank writes its own RNG state.

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
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist

from shardwise.runtime.checkpoint.background import BackgroundWriter, HostBuffers
from shardwise.runtime.checkpoint.expert_state import expert_meta, expert_pieces
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
from shardwise.runtime.checkpoint.state import capture_rng_state, check_json, describe_optimizer, encode_value
from shardwise.runtime.checkpoint.zenflow_state import save_zenflow
from shardwise.runtime.engine_protocol import EngineProtocol


def save_checkpoint(
    engine: EngineProtocol, save_dir: str | os.PathLike, tag: str | None = None, client_state: dict | None = None,
    *, writer: BackgroundWriter | None = None, exclude_frozen: bool = False,
) -> str:
    """Write a checkpoint of `engine` under `save_dir/tag` (default tag: global_step<N>) and
    point `save_dir/latest` at it. Collective: every rank calls it. Returns the tag.

    `client_state` (rank 0's is kept) must be JSON: str keys; tuples come back as lists.
    With a `writer` (asynchronous saves, background.py) it returns once this rank's share
    is copied to host memory; the writer's thread writes and publishes it.
    `exclude_frozen` (DeepSpeed's `exclude_frozen_parameters`, which the Hugging Face
    Trainer asks for a PEFT model): the parameters nothing trains are left out, as the
    base weights of LoRA training come from where the model was loaded; such a checkpoint
    loads with `strict=False`, which keeps the model's own values for them.
    """
    if not engine.trains:
        raise RuntimeError("save_checkpoint: this engine was given no optimizer (forward only), so it has no "
                           "training state to resume; write its weights with engine.save_16bit_model(dir)")
    if writer is not None:
        writer.wait()  # one save at a time; a failed earlier write raises here, on every rank
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
    if exclude_frozen:
        model = {**model, "parameters": [entry for entry in model["parameters"] if entry["trainable"]],
                 "frozen_parameters_excluded": True}
    _together(engine.rank, _world_agreement(engine), prepare, "preparing the checkpoint directory")
    if writer is None:
        _together(engine.rank, _world_agreement(engine), lambda: _write_rank_files(engine, staging, exclude_frozen),
                  "writing its checkpoint files")
        _together(engine.rank, _world_agreement(engine),
                  lambda: _publish(engine.rank, engine.world_size, root, tag, staging,
                                   _meta(engine, tag, client_state, model) if engine.rank == 0 else None),
                  "publishing the checkpoint")
        return tag

    steps: dict[str, Callable[[], None]] = {}

    def capture() -> None:  # everything the write needs, taken now: training changes it next
        meta = _meta(engine, tag, json.loads(json.dumps(client_state)), model) if engine.rank == 0 else None
        steps["write"] = _capture_rank_files(engine, staging, writer.buffers, exclude_frozen)
        steps["publish"] = lambda: _publish(engine.rank, engine.world_size, root, tag, staging, meta)

    _together(engine.rank, _world_agreement(engine), capture, "copying its checkpoint state to host memory")
    agreement = _group_agreement(writer.group())

    def write() -> None:
        _together(engine.rank, agreement, steps["write"], "writing its checkpoint files")
        _together(engine.rank, agreement, steps["publish"], "publishing the checkpoint")

    writer.start(tag, write)
    return tag


def _remove_leftovers(root: Path) -> None:
    """Partial directories of saves that were killed or failed, whatever their tag: they
    are never loadable (no manifest, never renamed), only taking disk space."""
    for entry in root.glob(".*.partial"):
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)


class _Agreement(NamedTuple):
    """How the ranks agree on a phase: `all_min(flag)` (an all-reduce with MIN, in place)
    and `gather(value)` (every rank's picklable value)."""

    all_min: Callable[[torch.Tensor], None]
    gather: Callable[[object], list]


def _world_agreement(engine: EngineProtocol) -> _Agreement:
    """Over every rank, on the training thread."""
    return _Agreement(
        lambda flag: engine.world.control_all_reduce(flag, "checkpoint: did every rank succeed",
                                                     op=dist.ReduceOp.MIN),
        engine.world.control_all_gather_object,
    )


def _group_agreement(group: dist.ProcessGroup | None) -> _Agreement:
    """Over the background writers' own group (None: one rank, nothing to agree with)."""
    if group is None:
        return _Agreement(lambda flag: None, lambda value: [value])

    def gather(value: object) -> list:
        values: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(values, value, group=group)
        return values

    return _Agreement(lambda flag: dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group), gather)


def _together(rank: int, agreement: _Agreement, step: Callable[[], None], what: str) -> None:
    """Run `step` on every rank; if any rank fails, every rank raises."""
    error: BaseException | None = None
    try:
        step()
    except Exception as caught:  # re-raised below, after the peers know
        error = caught
    flag = torch.tensor([0 if error is not None else 1])
    agreement.all_min(flag)
    if flag.item() == 1:
        return
    failures = agreement.gather(None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    failed, failure = next((rank, failure) for rank, failure in enumerate(failures) if failure is not None)
    raise CheckpointError(f"rank {rank}: rank {failed} failed while {what}: {failure}")


def _publish(rank: int, world_size: int, root: Path, tag: str, staging: Path, meta: dict | None) -> None:
    """Rank 0, once every rank's files are written: meta, manifest, then the renames."""
    if rank == 0:
        write_synced(staging / META, json.dumps(meta, indent=1))
        _write_manifest(world_size, staging)
        publish(root, tag)


class _RankShare(NamedTuple):
    """What a rank writes: its tensors in file order (key, values, optimizer sub-group:
    -1 for none) and its JSON record, less the tensor file's checksum."""

    tensors: list[tuple[str, torch.Tensor, int]]
    record: dict[str, Any]


def _write_rank_files(engine: EngineProtocol, staging: Path, exclude_frozen: bool) -> None:
    """This rank's pieces (safetensors) and its record (JSON): piece list, optimizer
    scalars per param group, RNG state, and the checksum of its tensor file. The tensors
    are streamed from the buffers training uses, sub-group by sub-group: a paging store
    (NVMe) holds only the one being written."""
    share = _rank_share(engine, staging, exclude_frozen)
    if share.tensors:
        path = staging / rank_tensors(engine.rank)
        entries = [TensorEntry(key, tensor.dtype, (tensor.numel(),)) for key, tensor, _ in share.tensors]
        with SafetensorsWriter(path, entries, metadata={"format": "pt"}) as writer:
            _stream(engine, share.tensors, writer.write)
            share.record["files"][path.name] = writer.close()
    write_synced(staging / rank_json(engine.rank), json.dumps(share.record))


def _capture_rank_files(engine: EngineProtocol, staging: Path, buffers: HostBuffers,
                        exclude_frozen: bool) -> Callable[[], None]:
    """Copy this rank's share to host `buffers` now; return the write of its files from
    those copies (which touches no training state, so it can run on another thread)."""
    share = _rank_share(engine, staging, exclude_frozen)
    copies: list[tuple[str, torch.Tensor]] = []
    _stream(engine, share.tensors, lambda key, tensor: copies.append((key, buffers.copy(key, tensor))))
    buffers.settle()
    buffers.keep_only({key for key, _ in copies})
    record = share.record

    def write() -> None:
        if copies:
            path = staging / rank_tensors(engine.rank)
            entries = [TensorEntry(key, tensor.dtype, (tensor.numel(),)) for key, tensor in copies]
            with SafetensorsWriter(path, entries, metadata={"format": "pt"}) as writer:
                for key, tensor in copies:
                    writer.write(key, tensor)
                record["files"][path.name] = writer.close()
        write_synced(staging / rank_json(engine.rank), json.dumps(record))

    return write


def _stream(engine: EngineProtocol, tensors: list[tuple[str, torch.Tensor, int]],
            consume: Callable[[str, torch.Tensor], Any]) -> None:
    """`consume(key, values)` for each tensor, its optimizer sub-group resident meanwhile."""
    for sub_group, items in itertools.groupby(tensors, key=lambda item: item[2]):
        with engine.zero.resident(sub_group if sub_group >= 0 else None):
            for key, tensor, _ in items:
                consume(key, tensor)


def _writes_extras(engine: EngineProtocol) -> bool:
    """Frozen parameters and buffers are whole on every rank holding their pipeline stage:
    the stage's first rank writes them (rank 0 without a pipeline), so a later stage's
    buffers are saved too."""
    return all(index == 0 for dimension, index in engine.mesh.coordinates.items() if dimension != "pipeline")


def _rank_share(engine: EngineProtocol, staging: Path, exclude_frozen: bool) -> _RankShare:
    """This rank's tensors (views of the training buffers, in file order) and record;
    `exclude_frozen`: without the parameters nothing trains."""
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
        for name, low, high, values in [] if exclude_frozen else zero.untrained_pieces():  # stage 3: frozen
            # weights are partitioned too
            if name not in shards and not first_tensor_rank:
                continue
            for start, run, stride, count, at in strided_pieces(owned_runs(low, high, shards.get(name))):
                add(name, start, start + (count - 1) * stride + run, {VALUE: values[at : at + run * count]}, -1,
                    *((run, stride) if count > 1 else ()))
    if _writes_extras(engine):
        for name, tensor in module_extras(engine, frozen=not exclude_frozen):
            add(name, 0, tensor.numel(), {VALUE: tensor.detach().reshape(-1)}, -1)
    experts_record = None
    if engine.experts is not None:  # experts trained apart from ZeRO, as pieces of their own (expert_state.py)
        written, experts_record = expert_pieces(engine)
        for name, start, stop, named in written:
            add(name, start, stop, named, -1)

    tensors.sort(key=lambda item: (item[2] < 0, item[2]))  # by sub-group; untrained pieces (-1) last
    record = {
        "rank": engine.rank,
        "pieces": pieces,
        "optimizer_groups": groups,
        "rng": capture_rng_state(engine.device),
        "files": files,
    }
    if zenflow_record is not None:
        record["zenflow"] = zenflow_record
    if experts_record is not None:
        record["experts"] = experts_record
    return _RankShare(tensors, record)


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


def _meta(engine: EngineProtocol, tag: str, client_state: dict, model: dict) -> dict:
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
        "optimizer": describe_optimizer(optimizer),
        "lr_scheduler": None if scheduler is None else encode_value(scheduler.state_dict(), "lr scheduler state"),
        "loss_scaler": engine.loss_scaler.state_dict() if engine.loss_scaler.dynamic else None,
        "counters": {
            "global_steps": engine.global_steps,
            "micro_steps": engine.micro_steps,
            "skipped_steps": engine.skipped_steps,
            "gradient_accumulation_steps": engine.gradient_accumulation_steps,
        },
        "client_state": client_state,
        "data_position": _data_position(engine),
        "random_ltd": engine.random_ltd.state_dict() if engine.random_ltd is not None else None,
        "hf": _hf_description(engine.module),
        "tensor_parallel": describe_tensor_parallel(engine),
    }
    if engine.experts is not None:
        meta["experts"] = expert_meta(engine)
    return meta


def _data_position(engine: EngineProtocol) -> dict | None:
    """Where the loader the engine was given stands (epoch, samples consumed, seed): the
    ranks step together, so rank 0's position is every rank's. None: the engine reads no
    loader of its own (the caller's loader is the caller's to save, in client_state)."""
    if engine.data_position is None:
        return None
    position = engine.data_position.state_dict()
    check_json(position, "the data loader's position")
    return position


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
