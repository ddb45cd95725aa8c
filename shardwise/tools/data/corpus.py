"""A byte-level training corpus that every machine already has: the standard library's source.

The main job must run offline and give the same numbers on every machine with the same
Python, so the corpus is the interpreter's own `*.py` files, read in sorted order and cut
at a byte budget. Bytes are the tokens (vocabulary 256), so there is no tokenizer to ship.

Building it means reading a few hundred files; the result is cached as one flat file
that the training ranks memory-map, so N ranks do not each rebuild it.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
import tempfile
from pathlib import Path

import numpy as np

DEFAULT_MAX_BYTES = 8_000_000
VAL_FRACTION = 0.1
# Third-party packages live inside the stdlib directory on most installs; they differ
# from machine to machine, so they are not part of the corpus.
EXCLUDED_DIRECTORIES = ("site-packages", "dist-packages")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_source_files(root: Path | None = None) -> list[Path]:
    """The standard library's `*.py` files, sorted by path relative to `root`."""
    root = root or stdlib_root()
    files = []
    for directory, subdirectories, names in os.walk(root):
        subdirectories[:] = [name for name in subdirectories if name not in EXCLUDED_DIRECTORIES]
        files.extend(Path(directory, name) for name in names if name.endswith(".py"))
    return sorted(files, key=lambda path: path.relative_to(root).as_posix())


def build_corpus(max_bytes: int = DEFAULT_MAX_BYTES, root: Path | None = None) -> bytes:
    """The first `max_bytes` of the sorted source files, concatenated."""
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    chunks: list[bytes] = []
    total = 0
    for path in stdlib_source_files(root):
        chunk = path.read_bytes()
        chunks.append(chunk)
        total += len(chunk)
        if total >= max_bytes:
            break
    corpus = b"".join(chunks)[:max_bytes]
    if not corpus:
        raise RuntimeError(f"no Python source files found under {root or stdlib_root()}")
    return corpus


def corpus_cache_path(cache_dir: str | os.PathLike, max_bytes: int = DEFAULT_MAX_BYTES) -> Path:
    """Where the corpus for this interpreter and byte budget is cached.

    The name carries the Python version and the stdlib location, so a different
    interpreter never reads another's corpus.
    """
    identity = f"{sys.version}|{stdlib_root()}|{max_bytes}".encode()
    digest = hashlib.sha256(identity).hexdigest()[:12]
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    return Path(cache_dir) / f"stdlib-py{version}-{max_bytes}-{digest}.bin"


def prepare_corpus(cache_dir: str | os.PathLike, max_bytes: int = DEFAULT_MAX_BYTES) -> Path:
    """Build the corpus into the cache unless it is there already; returns its path.

    Written to a temporary file and renamed, so a reader never sees half a corpus.
    """
    path = corpus_cache_path(cache_dir, max_bytes)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    corpus = build_corpus(max_bytes)
    with tempfile.NamedTemporaryFile(dir=path.parent, delete=False, suffix=".tmp") as file:
        file.write(corpus)
    os.replace(file.name, path)
    return path


def load_tokens(path: str | os.PathLike) -> np.ndarray:
    """The cached corpus as a read-only uint8 array (memory-mapped, shared by the ranks)."""
    return np.memmap(path, dtype=np.uint8, mode="r")


def split_tokens(tokens: np.ndarray, val_fraction: float = VAL_FRACTION) -> tuple[np.ndarray, np.ndarray]:
    """(train, val): the last `val_fraction` of the corpus is held out.

    A contiguous tail rather than random bytes, so validation text comes from files the
    model never trained on.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    boundary = int(len(tokens) * (1.0 - val_fraction))
    return tokens[:boundary], tokens[boundary:]
