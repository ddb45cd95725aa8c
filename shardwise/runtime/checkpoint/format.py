"""What a checkpoint directory looks like on disk, and the error every reader raises.

    DIR/
      latest                    the tag of the newest complete checkpoint, replaced last
      TAG/
        meta.json               model description, optimizer groups, counters, scheduler,
                                loss scaler, client_state (and the HF config, if any)
        rank_00000.json         one per rank: its pieces, optimizer scalars, RNG state
        rank_00000.safetensors  that rank's pieces: fp32 values and per-element optimizer state
        manifest.json           byte size and sha256 of every other file
      .TAG.partial/             a save in progress (a crash leaves it; the next save clears it)

Inside a rank file, tensor `<param>[<start>:<stop>]/<what>` holds elements [start, stop)
of the flattened parameter: `value` (its fp32 master values; frozen parameters and
buffers in their own dtype) or one per-element optimizer state (`exp_avg`, ...).
Everything is keyed by parameter *name* and element range, never by rank or flat-buffer
offset, so a checkpoint can be read back under any world size, stage or bucket size.
The experts of expert-parallel layers are pieces like the others, named as the
every-expert model names them (expert_state.py).
JSON and safetensors only: loading a checkpoint never runs code from it (no pickle).
"""

from __future__ import annotations

import errno
import json
import re
import shutil
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1
LATEST = "latest"
META = "meta.json"
MANIFEST = "manifest.json"
VALUE = "value"  # the tensor name of a piece's parameter values; optimizer states use theirs
_TAG_PATTERN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+=-]*")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupted, or does not fit the model."""


def rank_json(rank: int) -> str:
    return f"rank_{rank:05d}.json"


def rank_tensors(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


def staging_dir(root: Path, tag: str) -> Path:
    """Where a save is written before it is published under `tag`; hidden from tag listings."""
    return root / f".{tag}.partial"


def replaced_dir(root: Path, tag: str) -> Path:
    """Where an older checkpoint with the same tag waits while the new one takes its name."""
    return root / f".{tag}.replaced"


def piece_key(name: str, start: int, stop: int, tensor: str) -> str:
    return f"{name}[{start}:{stop}]/{tensor}"


def check_tag(tag: str) -> None:
    """Tags become directory names next to `latest` and the hidden staging directories."""
    if not isinstance(tag, str) or not _TAG_PATTERN.fullmatch(tag) or tag == LATEST:
        raise ValueError(
            f"invalid checkpoint tag {tag!r}: use letters, digits and _ . + = - "
            f"(not starting with '.' or '-', and not {LATEST!r})"
        )


def read_json(path: Path) -> Any:
    try:
        return json.loads(read_text(path))
    except json.JSONDecodeError as error:
        raise CheckpointError(f"checkpoint file {path} is not valid JSON: {error}") from None


_RESTORE = "it was corrupted or replaced; restore it from a copy, or save the checkpoint again"


def read_text(path: Path, fix: str = _RESTORE) -> str:
    """A checkpoint's small text file; every way it can be unreadable becomes a CheckpointError,
    ending with `fix` where the content is at fault."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing") from None
    except OSError as error:
        raise CheckpointError(f"cannot read checkpoint file {path}: {error.strerror}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise CheckpointError(
            f"checkpoint file {path} is not UTF-8 text (it starts {data[:16]!r}; byte 0x{data[error.start]:02x} "
            f"at offset {error.start} cannot be decoded), so it is not what shardwise wrote: {fix}"
        ) from None


def disk_full_error(error: OSError, path: Path, needed: int) -> CheckpointError | None:
    """The error to raise instead of `error` when it says the disk or quota is full: naming the
    file, its size and the space left, so the fix (free space, save elsewhere) is obvious."""
    if error.errno not in (errno.ENOSPC, errno.EDQUOT):
        return None
    reason = "no space left on device" if error.errno == errno.ENOSPC else "disk quota exceeded"
    try:
        free = f"{shutil.disk_usage(path.parent).free:,} bytes are free"
    except OSError:
        free = "the free space cannot be read"
    return CheckpointError(
        f"cannot write {path}: {reason}; the file needs {needed:,} bytes and {free} on its file system. "
        "Free some space (or raise the quota), or write to another directory"
    )
