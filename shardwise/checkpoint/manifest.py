"""Making a save all-or-nothing, and proving a checkpoint is the one that was written.

Publishing is a sequence of renames, each atomic on a POSIX file system, so a process
killed at any instant leaves either the old state or the new one:

1. every file is written (and fsync'ed) under `.TAG.partial/`;
2. `manifest.json` records the size and sha256 of each file, and is written last;
3. the directory is renamed to `TAG` (an older `TAG` is first moved aside, and put back
   by `resolve_tag` if a crash came between the two renames);
4. `latest` is replaced through a temporary file and `os.replace`.

Loading verifies sizes and checksums before reading any tensor, so a truncated or edited
file is reported by name instead of producing a model that is silently wrong.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from shardwise.checkpoint.format import (
    LATEST,
    MANIFEST,
    CheckpointError,
    read_json,
    replaced_dir,
    staging_dir,
)

HASH_BLOCK = 1 << 20


def file_digest(path: Path) -> tuple[int, str]:
    """(size, sha256) read through one small reused buffer, so hashing costs no memory."""
    digest = hashlib.sha256()
    buffer = bytearray(HASH_BLOCK)
    view = memoryview(buffer)
    size = 0
    with open(path, "rb", buffering=0) as handle:
        while count := handle.readinto(buffer):
            digest.update(view[:count])
            size += count
    return size, digest.hexdigest()


def write_synced(path: Path, text: str) -> None:
    with open(path, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def fsync_dir(path: Path) -> None:
    """Make renames and new entries in `path` durable."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_manifest(directory: Path, files: dict[str, tuple[int, str]]) -> None:
    entries = {name: {"bytes": size, "sha256": digest} for name, (size, digest) in sorted(files.items())}
    write_synced(directory / MANIFEST, json.dumps({"files": entries}, indent=1))


def read_manifest(directory: Path) -> dict[str, dict]:
    manifest = read_json(directory / MANIFEST)
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"checkpoint file {directory / MANIFEST} has no 'files' table")
    return manifest["files"]


def check_file(directory: Path, name: str, expected: dict) -> str | None:
    """Why `name` does not match its manifest entry, or None when it does."""
    path = directory / name
    if not path.is_file():
        return f"checkpoint file {path} is missing"
    size = path.stat().st_size
    if size != expected["bytes"]:
        return (f"checkpoint file {path} has {size} bytes but the manifest records "
                f"{expected['bytes']} (truncated or incompletely copied)")
    if file_digest(path)[1] != expected["sha256"]:
        return (f"checkpoint file {path} does not match its sha256 in the manifest "
                "(the file was altered or corrupted)")
    return None


def publish(root: Path, tag: str) -> None:
    """Give the finished staging directory its tag, then point `latest` at it."""
    staging, final, aside = staging_dir(root, tag), root / tag, replaced_dir(root, tag)
    fsync_dir(staging)
    if final.exists():
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(final, aside)
    os.rename(staging, final)
    fsync_dir(root)
    shutil.rmtree(aside, ignore_errors=True)
    temporary = root / f".{LATEST}.partial"
    write_synced(temporary, tag + "\n")
    os.replace(temporary, root / LATEST)
    fsync_dir(root)


def list_tags(root: Path) -> list[str]:
    """Complete checkpoints under `root` (hidden staging directories are not tags)."""
    if not root.is_dir():
        return []
    return sorted(
        entry.name for entry in root.iterdir()
        if not entry.name.startswith(".") and (entry / MANIFEST).is_file()
    )


def resolve_tag(root: Path, tag: str | None) -> Path:
    """The directory of `tag` (None: the one `latest` names), or an error listing the tags."""
    if tag is None:
        pointer = root / LATEST
        if not pointer.is_file():
            raise CheckpointError(
                f"no '{LATEST}' file in {root}, so no tag to load by default; "
                f"tags present: {_tag_list(root)}"
            )
        tag = pointer.read_text().strip()
    directory = root / tag
    aside = replaced_dir(root, tag)
    if not directory.exists() and (aside / MANIFEST).is_file():
        try:  # a save replacing this tag died between its two renames: undo the first
            os.rename(aside, directory)
        except OSError:
            pass  # another rank put it back first
    if not (directory / MANIFEST).is_file():
        what = "is incomplete (no manifest.json)" if directory.exists() else "does not exist"
        raise CheckpointError(f"checkpoint tag {tag!r} in {root} {what}; tags present: {_tag_list(root)}")
    return directory


def _tag_list(root: Path) -> str:
    return ", ".join(list_tags(root)) or "none"
