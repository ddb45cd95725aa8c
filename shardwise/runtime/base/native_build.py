"""C files compiled on first use into a per-machine cache, the way DeepSpeed builds its
CPU ops: the optimizer kernels (optim/native_kernels.c) and the shared-memory collectives
(distributed/shared_memory.c). No torch headers, so any torch; loaded with ctypes by
their callers. The cache key is the source and the command, so an edited file or another
compiler builds afresh, and the finished library is moved into place atomically, since
several ranks may build at once. `CompiledLibrary` builds and loads one on first use,
falling back (warned once) where no compiler can."""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

CACHE_VARIABLE = "SHARDWISE_CACHE_DIR"


def build_once(source: Path, *, folder: str, flags: Sequence[str], variants: Sequence[Sequence[str]] = ((),),
               libraries: Sequence[str] = ()) -> Path:
    """The shared library built from `source` (in $SHARDWISE_CACHE_DIR, else
    ~/.cache/shardwise, under `folder`). `variants` are extra flags tried in order until one
    compiles (OpenMP where the compiler has it); raises RuntimeError without a compiler or
    when none compiles."""
    text = source.read_bytes()
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler found (cc, gcc, or $CC)")
    key = hashlib.sha256(text + " ".join([compiler, *flags]).encode()).hexdigest()[:16]
    cache = Path(os.environ.get(CACHE_VARIABLE, Path.home() / ".cache" / "shardwise")) / folder
    target = cache / f"{source.stem}_{key}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as scratch:
        built = Path(scratch) / target.name
        for extra in variants:
            result = subprocess.run([compiler, *flags, *extra, str(source), "-o", str(built), *libraries],
                                    capture_output=True, text=True, timeout=120)
            if result.returncode == 0:
                break
        else:
            raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-500:]}")
        os.replace(built, target)  # atomic: ranks building at once each install a whole file
    return target


class CompiledLibrary:
    """A C file's library, built and loaded on the first `get()` and kept for the process;
    None where it cannot be built (no compiler, a failed build), said once in a warning
    that ends with `fallback`: what runs instead."""

    def __init__(self, load: Callable[[], ctypes.CDLL], *, what: str, fallback: str):
        self._load = load
        self.what = what
        self.fallback = fallback
        self.library: ctypes.CDLL | None = None
        self.tried = False
        self._loading = threading.Lock()

    def get(self) -> ctypes.CDLL | None:
        """The library; the first call builds and loads it while later ones, from any
        thread, wait: a thread that saw the first call's mark before its load finished
        took no library, and stepped its piece on the torch path while the other ranks'
        threads took the kernels (tests/runtime/optim/pieces.py runs ranks as threads)."""
        if self.tried:  # set only once `library` holds the load's result
            return self.library
        with self._loading:
            if not self.tried:
                try:
                    self.library = self._load()
                except (OSError, RuntimeError, subprocess.SubprocessError) as error:
                    warnings.warn(f"shardwise: {self.what} could not be built ({error}); {self.fallback} Install a "
                                  "C compiler (cc) to use them.", RuntimeWarning, stacklevel=4)
                self.tried = True
        return self.library
