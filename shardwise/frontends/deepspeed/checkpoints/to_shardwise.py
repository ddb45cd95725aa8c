"""A DeepSpeed checkpoint as shardwise's: the meta and rank records its loader restores from
(runtime/checkpoint/load.py), with the pieces read from DeepSpeed's tensors in memory,
or written to disk as a shardwise checkpoint (`shardwise convert --from-deepspeed`).

DeepSpeed's data-parallel ranks become the checkpoint's ranks (each keeps the pieces its
file held), so the loader reshards them to any world size and stage as it does its own.
What DeepSpeed's optimizers keep is translated to the torch optimizer shardwise trains
with: Adam's moments carry over element by element; the step becomes torch's 0-dim float
tensor; hyper-parameters that only DeepSpeed's kernels read (`bias_correction`, a group
`step`) are dropped. Optimizers whose state does not match are refused by name.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from shardwise.frontends.deepspeed.checkpoints.contents import DeepSpeedContents
from shardwise.runtime.checkpoint.format import (
    FORMAT_VERSION,
    META,
    VALUE,
    CheckpointError,
    check_tag,
    piece_key,
    rank_json,
    rank_tensors,
    staging_dir,
)
from shardwise.runtime.checkpoint.index import PieceIndex
from shardwise.runtime.checkpoint.load import OpenedCheckpoint
from shardwise.runtime.checkpoint.manifest import file_digest, publish, write_manifest, write_synced
from shardwise.runtime.checkpoint.safetensors_io import SafetensorsWriter, TensorEntry, dtype_name
from shardwise.runtime.checkpoint.state import check_json, encode_value
from shardwise.runtime.optim.registry import optimizer_spec
from shardwise.runtime.optim.torch_optimizers import torch_class_name

log = logging.getLogger("shardwise")

# per-element states each optimizer class keeps, by the class name shardwise builds
ADAM_STATES = ("exp_avg", "exp_avg_sq")
ELEMENT_STATES = {"Adam": ADAM_STATES, "AdamW": ADAM_STATES, "Lamb": ADAM_STATES, "OneBitAdam": ADAM_STATES,
                  "SGD": ("momentum_buffer",), "Lars": ("momentum_buffer",)}
# group keys only DeepSpeed's own kernels read
DEEPSPEED_ONLY_GROUP_KEYS = frozenset({"params", "step", "bias_correction", "adam_w_mode", "max_coeff", "min_coeff"})


def optimizer_class_of(contents: DeepSpeedContents) -> str | None:
    """The class shardwise builds for the checkpoint's config optimizer (None: the script
    passed its own optimizer, and the config does not say which)."""
    if contents.optimizer_type is None:
        return None
    params = (contents.ds_config.get("optimizer") or {}).get("params") or {}
    try:
        name = optimizer_spec(contents.optimizer_type, any_case=True).name
    except ValueError:
        return contents.optimizer_type
    return torch_class_name(name, params)


def opened_checkpoint(contents: DeepSpeedContents, *, optimizer_class: str,
                      group_keys: list[set[str]] | None = None, hysteresis: int | None = None,
                      optimizer_states: bool = True) -> OpenedCheckpoint:
    """`contents` as the loader's input, for an engine training with `optimizer_class`.
    `group_keys`: the hyper-parameters each of the engine's param groups has (others are
    not carried over); `hysteresis`: the engine's loss-scale hysteresis, for a checkpoint
    whose loss scaler did not record what remained of it (DeepSpeed's fp16 optimizer
    without ZeRO, whose own load keeps the configured value too). `optimizer_states`
    False: the weights only (no optimizer state is translated, so any optimizer loads them)."""
    meta = shardwise_meta(contents, optimizer_class=optimizer_class, group_keys=group_keys, hysteresis=hysteresis,
                          client_state=contents.client_state)
    if not optimizer_states:  # the loader checks the groups only to restore their state
        meta["optimizer"]["param_groups"] = [{} for _ in group_keys or contents.param_groups]
    elif group_keys is not None and len(group_keys) != len(contents.param_groups):
        raise CheckpointError(f"checkpoint {contents.directory} has {len(contents.param_groups)} optimizer param "
                              f"groups, this engine's optimizer has {len(group_keys)}: give the optimizer the "
                              "groups DeepSpeed trained, or load the weights only (load_optimizer_states=False)")
    records, tables = shardwise_records(contents, optimizer_class, optimizer_states=optimizer_states)
    index = PieceIndex(contents.directory, records, open_reader=lambda file: TensorTable(tables[file]))
    return OpenedCheckpoint(contents.directory, meta, records, index)


def shardwise_meta(contents: DeepSpeedContents, *, optimizer_class: str, group_keys: list[set[str]] | None,
                   hysteresis: int | None, client_state: dict) -> dict[str, Any]:
    groups = [_group_hyper_parameters(group, None if group_keys is None or index >= len(group_keys)
                                      else group_keys[index])
              for index, group in enumerate(contents.param_groups)]
    parameters = [{"name": parameter.name, "shape": list(parameter.shape), "trainable": parameter.group is not None,
                   "dtype": "float32" if parameter.group is not None else _dtype(contents.whole[parameter.name].dtype),
                   **({"group": parameter.group} if parameter.group is not None else {})}
                  for parameter in contents.parameters]
    buffers = [{"name": name, "shape": list(contents.whole[name].shape), "dtype": _dtype(contents.whole[name].dtype)}
               for name in contents.buffers]
    accumulation = contents.gradient_accumulation_steps or 1
    return {
        "format": FORMAT_VERSION,
        "tag": contents.directory.name,
        "world_size": contents.world_size,
        "stage": contents.stage,
        "dtype": _dtype(contents.dtype),
        "parameters": parameters,
        "buffers": buffers,
        "aliases": {},
        "optimizer": {"class": optimizer_class,
                      "param_groups": [{key: encode_value(value, f"param group {index} {key!r}")
                                        for key, value in group.items()} for index, group in enumerate(groups)]},
        "lr_scheduler": (None if contents.lr_scheduler is None
                         else encode_value(contents.lr_scheduler, "the checkpoint's lr scheduler state")),
        "loss_scaler": _loss_scaler(contents, hysteresis),
        "counters": {"global_steps": contents.global_steps, "micro_steps": contents.global_steps * accumulation,
                     "skipped_steps": contents.skipped_steps, "gradient_accumulation_steps": accumulation},
        "client_state": client_state,
        "random_ltd": contents.random_ltd,
        "hf": None,
        "tensor_parallel": None,
        "deepspeed": {"layout": contents.layout, "global_samples": contents.global_samples},
    }


def shardwise_records(contents: DeepSpeedContents, optimizer_class: str, *, optimizer_states: bool = True
                      ) -> tuple[list[dict], dict[str, dict[str, torch.Tensor]]]:
    """One record per DeepSpeed data-parallel rank (its pieces; rank 0 also the whole frozen
    parameters and buffers), and each rank's tensors by piece key."""
    kept = _kept_states(contents, optimizer_class) if optimizer_states else []
    records = [{"rank": rank, "pieces": [], "optimizer_groups": {}, "files": {}} for rank in range(contents.world_size)]
    tables: dict[str, dict[str, torch.Tensor]] = {rank_tensors(rank): {} for rank in range(contents.world_size)}
    group_of = {parameter.name: parameter.group for parameter in contents.parameters}
    for piece in contents.pieces:
        tensors = {VALUE: piece.tensors["value"], **{key: piece.tensors[key] for key in kept if key in piece.tensors}}
        _add(records[piece.rank], tables, piece.name, piece.start, piece.stop, tensors)
        group = group_of[piece.name]
        step = contents.group_steps[group] if group is not None and group < len(contents.group_steps) else None
        if step is not None and optimizer_states:
            records[piece.rank]["optimizer_groups"].setdefault(str(group), {
                "scalars": _scalars(optimizer_class, step),
                "elements": {key: dtype_name(torch.float32) for key in kept if key in piece.tensors},
            })
    for name, tensor in contents.whole.items():
        _add(records[0], tables, name, 0, tensor.numel(), {VALUE: tensor.reshape(-1)})
    return records, tables


def write_shardwise_checkpoint(contents: DeepSpeedContents, output: Path, *, optimizer_class: str,
                               tag: str | None = None) -> str:
    """`contents` as a shardwise checkpoint under `output/tag` (default: the DeepSpeed tag),
    published atomically like engine.save_checkpoint's; returns the tag. The client_state
    keeps its JSON values (a checkpoint's meta is JSON); others are dropped with a warning
    naming them."""
    tag = contents.directory.name if tag is None else tag
    check_tag(tag)
    client_state, dropped = _json_client_state(contents.client_state)
    meta = shardwise_meta(contents, optimizer_class=optimizer_class, group_keys=None, hysteresis=None,
                          client_state=client_state)
    records, tables = shardwise_records(contents, optimizer_class)
    output.mkdir(parents=True, exist_ok=True)
    staging = staging_dir(output, tag)
    if staging.exists():
        raise CheckpointError(f"{staging} exists: another conversion into {output} is running or died; remove it")
    staging.mkdir()
    files: dict[str, tuple[int, str]] = {}
    for record in records:
        table = tables[rank_tensors(record["rank"])]
        if table:
            path = staging / rank_tensors(record["rank"])
            entries = [TensorEntry(key, tensor.dtype, (tensor.numel(),)) for key, tensor in table.items()]
            with SafetensorsWriter(path, entries, metadata={"format": "pt"}) as writer:
                for key, tensor in table.items():
                    writer.write(key, tensor)
                files[path.name] = record["files"][path.name] = writer.close()
        write_synced(staging / rank_json(record["rank"]), json.dumps(record))
        files[rank_json(record["rank"])] = file_digest(staging / rank_json(record["rank"]))
    meta["tag"] = tag
    if dropped:
        log.warning("shardwise convert: client_state entries %s are not JSON values and were left out "
                    "(a shardwise checkpoint's meta is JSON)", dropped)
    write_synced(staging / META, json.dumps(meta, indent=1))
    files[META] = file_digest(staging / META)
    write_manifest(staging, files)
    publish(output, tag)
    return tag


class TensorTable:
    """A rank's tensors in memory, read like a safetensors file (index.py's PieceReader)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def entry(self, name: str) -> TensorEntry:
        tensor = self.tensors[name]
        return TensorEntry(name, tensor.dtype, (tensor.numel(),))

    def read_into(self, name: str, start: int, out: torch.Tensor) -> None:
        with torch.no_grad():  # `out` may be a view of a trained master
            out.copy_(self.tensors[name][start : start + out.numel()])

    def read(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self.tensors[name][start:stop].clone()

    def close(self) -> None:
        pass


# -- translation -----------------------------------------------------------------------------------
def _kept_states(contents: DeepSpeedContents, optimizer_class: str) -> list[str]:
    """The per-element states carried over: those `optimizer_class` keeps, each required
    wherever a group has stepped."""
    present = contents.state_names
    expected = ELEMENT_STATES.get(optimizer_class)
    if expected is None:
        raise CheckpointError(
            f"checkpoint {contents.directory} ({contents.layout}) holds optimizer state {present or 'none'}, which "
            f"shardwise cannot map onto {optimizer_class}'s (it maps Adam, AdamW, LAMB, 1-bit Adam, SGD and LARS); "
            "load the weights only (load_optimizer_states=False)")
    stepped = any(step is not None for step in contents.group_steps)
    missing = [key for key in expected if key not in present]
    if stepped and missing and not (optimizer_class in ("SGD", "Lars") and not present):
        raise CheckpointError(
            f"checkpoint {contents.directory} ({contents.layout}) holds optimizer state {present or 'none'}; "
            f"{optimizer_class} needs {list(expected)}: it was trained with another optimizer. Load the weights "
            "only (load_optimizer_states=False), or train with the optimizer it was saved with")
    return [key for key in expected if key in present]


def _scalars(optimizer_class: str, step: int) -> dict[str, Any]:
    """torch's optimizers (and shardwise's) count steps in a 0-dim float32 tensor; SGD keeps none."""
    if optimizer_class == "SGD":
        return {}
    return {"step": encode_value(torch.tensor(float(step), dtype=torch.float32), "step")}


def _group_hyper_parameters(group: dict[str, Any], keys: set[str] | None) -> dict[str, Any]:
    kept = {}
    for key, value in group.items():
        if key in DEEPSPEED_ONLY_GROUP_KEYS or (keys is not None and key not in keys):
            continue
        kept[key] = tuple(value) if key == "betas" else value
    return kept


def _loss_scaler(contents: DeepSpeedContents, hysteresis: int | None) -> dict | None:
    state = contents.loss_scaler
    if state is None:
        return None
    state = dict(state)
    if "remaining_hysteresis" not in state:
        fp16 = contents.ds_config.get("fp16") or {}
        state["remaining_hysteresis"] = hysteresis if hysteresis is not None else int(fp16.get("hysteresis", 2))
    return state


def _add(record: dict, tables: dict[str, dict[str, torch.Tensor]], name: str, start: int, stop: int,
         tensors: dict[str, torch.Tensor]) -> None:
    record["pieces"].append({"name": name, "start": start, "stop": stop, "tensors": list(tensors)})
    table = tables[rank_tensors(record["rank"])]
    for key, tensor in tensors.items():
        if tensor.numel() != stop - start:
            raise CheckpointError(f"{name}[{start}:{stop}]/{key} has {tensor.numel()} elements in the checkpoint")
        table[piece_key(name, start, stop, key)] = tensor


def _json_client_state(client_state: dict) -> tuple[dict, list[str]]:
    kept, dropped = {}, []
    for key, value in client_state.items():
        try:
            check_json({key: value})
        except TypeError:
            dropped.append(str(key))
            continue
        kept[key] = value
    return kept, dropped


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")

