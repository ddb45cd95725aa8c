"""Is `load_dir` (with `tag`, or the tag its `latest` names) a DeepSpeed checkpoint?

A user who switches from DeepSpeed in the middle of a run points `load_checkpoint` at the
folder DeepSpeed saved into (or at a Hugging Face Trainer's `checkpoint-N`, which holds
DeepSpeed's `latest` and `global_stepN/`), so the format is recognised from the files:
a tag folder without shardwise's manifest.json that holds DeepSpeed's model files, its
pipeline layer files, or `ds_to_universal`'s `zero/` folder.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from shardwise.runtime.checkpoint.format import LATEST, MANIFEST, check_tag

DEEPSPEED_FILE = re.compile(r"(zero_pp_rank_\d+_)?mp_rank_\d+_model_states\.pt|layer_\d+-model_states\.pt")


def deepspeed_checkpoint_dir(load_dir: str | os.PathLike, tag: str | None = None) -> Path | None:
    """The tag's folder when it holds a DeepSpeed checkpoint; None otherwise (shardwise's own
    format, or nothing there: shardwise's loader then says what is missing)."""
    root = Path(load_dir)
    if tag is None:
        latest = root / LATEST
        if not latest.is_file():
            return None
        try:
            tag = latest.read_text().strip()
        except (OSError, UnicodeDecodeError):
            return None
    try:
        check_tag(tag)  # a tag names a folder beside `latest`, never a path
    except ValueError:
        return None
    directory = root / tag
    if not directory.is_dir() or (directory / MANIFEST).exists():
        return None
    if (directory / "zero").is_dir() or any(DEEPSPEED_FILE.fullmatch(entry.name) for entry in directory.iterdir()):
        return directory
    return None
