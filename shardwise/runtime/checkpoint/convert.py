"""Consolidate a sharded checkpoint into plain safetensors, optionally as a Hugging Face folder.

The output is written as a stream: each tensor is assembled from the rank files one
block of at most `BLOCK_ELEMENTS` elements at a time, cast, written and dropped before
the next block is read, so the converter's memory is one block (at most the largest
parameter), whatever the size of the model. Output shards are cut at `max_shard_size`
and described by an index in Hugging Face's `model.safetensors.index.json` layout.

Tied parameters are written once, under their first name, as `save_pretrained` does;
`from_pretrained` ties them again from the config.

Existing output is never replaced silently: an earlier conversion's files with the same
stem (single file, shards, index, and config.json for `hf`) make the conversion refuse
unless `overwrite` is given, and are then all removed first, because a stale
`model.safetensors` beside a new sharded index is what `from_pretrained` would load.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from shardwise.runtime.checkpoint.format import META, VALUE, CheckpointError, rank_json, read_json
from shardwise.runtime.checkpoint.index import PieceIndex
from shardwise.runtime.checkpoint.manifest import check_file, read_manifest, resolve_tag
from shardwise.runtime.checkpoint.safetensors_io import SafetensorsWriter, TensorEntry

BLOCK_ELEMENTS = 1 << 24
OUTPUT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str | int) -> int:
    """Bytes from '5GB' (10**9, as Hugging Face counts), '500MiB' or a plain integer."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in _SIZE_UNITS:
        raise ValueError(f"cannot read size {text!r}: use e.g. 5GB, 500MB, 2GiB or a number of bytes")
    size = int(float(match.group(1)) * _SIZE_UNITS[match.group(2).upper()])
    if size <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return size


def convert_checkpoint(
    checkpoint_dir: str | os.PathLike,
    output: str | os.PathLike,
    tag: str | None = None,
    dtype: str = "fp32",
    max_shard_size: str | int = "5GB",
    hf: bool = False,
    overwrite: bool = False,
) -> list[Path]:
    """Write the model of a checkpoint as consolidated safetensors; returns the files written.

    `output` is a directory (files `model.safetensors`, or `model-0000i-of-0000n.safetensors`
    plus `model.safetensors.index.json`), or a `*.safetensors` path whose stem replaces
    "model". `hf=True` also writes `config.json` (the model must be a `transformers` one).
    `overwrite=True` replaces the files of an earlier conversion there (see the module doc).
    """
    if dtype not in OUTPUT_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(OUTPUT_DTYPES)}, got {dtype!r}")
    max_bytes = parse_size(max_shard_size)
    output = Path(output)
    folder, stem = (output.parent, output.stem) if output.suffix == ".safetensors" else (output, "model")
    if hf and stem != "model":
        raise ValueError("--hf writes a folder; give a directory as the output, not a .safetensors file")
    earlier = _check_output(folder, stem, hf, overwrite)
    directory, meta, records = open_verified(checkpoint_dir, tag)
    if hf and meta.get("hf") is None:
        raise CheckpointError(f"checkpoint {directory} has no Hugging Face config: the model "
                              "was not a transformers PreTrainedModel, so --hf cannot apply")
    target = OUTPUT_DTYPES[dtype]
    with _writing(folder):
        folder.mkdir(parents=True, exist_ok=True)
        for path in earlier:
            path.unlink(missing_ok=True)
    written = []
    with PieceIndex(directory, records) as index:
        entries = []
        for item in meta["parameters"] + meta["buffers"]:
            index.check_complete(item["name"], math.prod(item["shape"]))
            stored = getattr(torch, item["dtype"])
            entries.append(TensorEntry(item["name"], target if stored.is_floating_point else stored,
                                       tuple(item["shape"])))
        shards = _plan_shards(entries, max_bytes)
        names = ([f"{stem}.safetensors"] if len(shards) == 1 else
                 [f"{stem}-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)])
        for shard, name in zip(shards, names):
            with _writing(folder / name):
                written.append(_write_shard(index, folder / name, shard))
        if len(shards) > 1:
            weight_map = {entry.name: name for shard, name in zip(shards, names) for entry in shard}
            total = sum(entry.nbytes for entry in entries)
            written.append(folder / f"{stem}.safetensors.index.json")
            with _writing(written[-1]):
                written[-1].write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                  indent=2))
    if hf:
        written.append(folder / "config.json")
        with _writing(written[-1]):
            written[-1].write_text(json.dumps(_hf_config(meta["hf"], target), indent=2))
    return written


def open_verified(checkpoint_dir: str | os.PathLike, tag: str | None) -> tuple[Path, dict, list[dict]]:
    """(the tag's directory, its meta, every rank's record) after checking every file
    against the manifest, in one process (no engine: conversions and zero_to_fp32)."""
    directory = resolve_tag(Path(checkpoint_dir), tag)
    files = read_manifest(directory)
    for name in sorted(files):
        problem = check_file(directory, name, files[name])
        if problem is not None:
            raise CheckpointError(problem)
    meta = read_json(directory / META)
    return directory, meta, [read_json(directory / rank_json(rank)) for rank in range(meta["world_size"])]


def _check_output(folder: Path, stem: str, hf: bool, overwrite: bool) -> list[Path]:
    """Refuse, before the checkpoint is read, an output that cannot be created or would replace
    files without `overwrite`; return the earlier outputs to remove."""
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise CheckpointError(f"cannot create output directory {folder}: {existing} is a file, not a directory; "
                              "choose another output path")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise CheckpointError(f"cannot write to {folder}: {existing} is not writable by this user; "
                              "choose another output path")
    if not folder.is_dir():
        return []
    name = re.escape(stem)
    outputs = re.compile(rf"{name}(-\d{{5}}-of-\d{{5}})?\.safetensors|{name}\.safetensors\.index\.json"
                         + (r"|config\.json" if hf else ""))
    earlier = sorted(path for path in folder.iterdir() if outputs.fullmatch(path.name) and not path.is_dir())
    if earlier and not overwrite:
        one = len(earlier) == 1
        shown = ", ".join(str(path) for path in earlier[:3])
        shown += f" and {len(earlier) - 3} more" if len(earlier) > 3 else ""
        raise CheckpointError(
            f"output file{'' if one else 's'} {shown} already exist{'s' if one else ''}: pass --overwrite "
            f"(overwrite=True in convert_checkpoint) to replace {'it' if one else 'them'}, or choose another output"
        )
    return earlier


@contextmanager
def _writing(path: Path) -> Iterator[None]:
    """An output that cannot be created or written is a path for the user to change, not a crash."""
    try:
        yield
    except OSError as error:
        raise CheckpointError(f"cannot write {error.filename or path}: {error.strerror}; "
                              "choose an output path you can write to") from None


def _plan_shards(entries: list[TensorEntry], max_bytes: int) -> list[list[TensorEntry]]:
    """In order, closing a shard before it would exceed `max_bytes` (a tensor larger than
    that gets a shard of its own)."""
    shards: list[list[TensorEntry]] = [[]]
    size = 0
    for entry in entries:
        if shards[-1] and size + entry.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry.nbytes
    return shards


def _write_shard(index: PieceIndex, path: Path, entries: list[TensorEntry]) -> Path:
    with SafetensorsWriter(path, entries, metadata={"format": "pt"}) as writer:
        for entry in entries:
            for start in range(0, max(entry.numel, 1), BLOCK_ELEMENTS):  # empty tensors too
                stop = min(start + BLOCK_ELEMENTS, entry.numel)
                writer.write(entry.name, index.read(entry.name, VALUE, start, stop, entry.dtype))
        writer.close()
    return path


def _hf_config(hf: dict, dtype: torch.dtype) -> dict:
    config = dict(hf["config"])
    if not config.get("architectures"):
        config["architectures"] = [hf["class"]]
    dtype_name = str(dtype).removeprefix("torch.")
    keys = [key for key in ("dtype", "torch_dtype") if key in config] or ["torch_dtype"]
    for key in keys:
        config[key] = dtype_name
    return config
