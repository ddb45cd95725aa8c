"""Making a save all-or-nothing, and proving a checkpoint is the one that was written.

Publishing is a sequence of renames, each atomic on a POSIX file system, so a process
killed at any instant leaves either the old state or the new one:

1. every file is written (and fsync'ed) under `.TAG.partial/`;
2. `manifest.json` records the size and sha256 of each file, and is written last;
3. the directory is renamed to `TAG` (an older `TAG` is first moved aside, and put back
   by `resolve_tag` if a crash came between the two renames);
4. `latest` is replaced through a temporary file and `os.replace`.

Loading verifies sizes and checksums before reading any tensor, so a truncated or edited
file is reported by name instead of producing a model that is silently wrong. For that to
cover everything a loader reads, the manifest must list every file in the directory: a
file it does not list (a rank file copied in from another run, say) is an error too.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

from shardwise.runtime.checkpoint.format import (
    LATEST,
    MANIFEST,
    CheckpointError,
    check_tag,
    disk_full_error,
    read_json,
    read_text,
    replaced_dir,
    staging_dir,
)

HASH_BLOCK = 1 << 20
_SHA256 = re.compile(r"[0-9a-f]{64}")
_GIVE_TAG = "or give the tag to load (tag= in load_checkpoint, --tag in shardwise convert)"


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
    data = text.encode()
    try:
        with open(path, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as error:
        full = disk_full_error(error, path, len(data))
        if full is None:
            raise
        raise full from None


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
    """The manifest's table of files, name -> {"bytes", "sha256"}, once every entry is well
    formed and every file in `directory` has one (so checking the listed files checks
    everything a loader can read)."""
    path = directory / MANIFEST
    manifest = read_json(path)
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"checkpoint file {path} has no 'files' table")
    files = manifest["files"]
    for name, entry in files.items():
        problem = _entry_problem(name, entry)
        if problem is not None:
            raise CheckpointError(
                f"checkpoint file {path} lists {name!r} {problem}: the manifest was damaged or edited, so the "
                "checkpoint cannot be verified; restore manifest.json from a copy, or save the checkpoint again"
            )
    unlisted = sorted(entry.name for entry in directory.iterdir()
                      if entry.name != MANIFEST and entry.name not in files)
    if unlisted:
        raise CheckpointError(
            f"checkpoint {directory} holds {', '.join(unlisted)}, which its manifest does not list: an unlisted "
            "file cannot be verified, yet a loader would read it; remove it if it does not belong to this "
            "checkpoint (e.g. copied in from another run), or save the checkpoint again"
        )
    return files


def _entry_problem(name: str, entry: object) -> str | None:
    """What is wrong with one manifest entry as `write_manifest` writes them, or None."""
    if not name or name in (".", "..", MANIFEST) or "/" in name or "\\" in name:
        return "as a file, which is not a file name inside the checkpoint directory"
    if not isinstance(entry, dict):
        return f"with {entry!r} instead of its bytes and sha256"
    if "bytes" not in entry:
        return "without its 'bytes'"
    if "sha256" not in entry:
        return "without its 'sha256'"
    size, digest = entry["bytes"], entry["sha256"]
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        return f"with bytes {size!r}, which is not a byte count"
    if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
        return f"with sha256 {digest!r}, which is not a sha256 hex digest"
    return None


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
    """The directory of `tag` (None: the one `latest` names), or an error listing the tags.
    Tags are plain names (`check_tag`), so neither argument nor `latest` can reach outside `root`."""
    if tag is None:
        tag = read_latest(root)
    else:
        check_tag(tag)
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


def read_latest(root: Path) -> str:
    """The tag `root/latest` names, which `publish` wrote as one line."""
    pointer = root / LATEST
    if not pointer.is_file():
        raise CheckpointError(
            f"no '{LATEST}' file in {root}, so no tag to load by default; "
            f"tags present: {_tag_list(root)}"
        )
    fix = f"write one of the tags present ({_tag_list(root)}) into it, {_GIVE_TAG}"
    text = read_text(pointer, fix)
    tag = text.strip()
    if not tag:
        what = "is empty" if not text else f"holds only whitespace ({text!r})"
        raise CheckpointError(
            f"checkpoint file {pointer} {what}: it should hold the tag of the newest checkpoint; {fix}"
        )
    try:
        check_tag(tag)
    except ValueError:
        shown = tag if len(tag) <= 80 else tag[:80] + "..."
        raise CheckpointError(
            f"checkpoint file {pointer} holds {shown!r}, which is not a checkpoint tag: a tag names a directory "
            f"beside '{LATEST}' (letters, digits and _ . + = -), never a path with '/' or '..'; {fix}"
        ) from None
    return tag


def _tag_list(root: Path) -> str:
    return ", ".join(list_tags(root)) or "none"
