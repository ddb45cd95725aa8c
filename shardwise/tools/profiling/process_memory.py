"""Memory the training process actually uses, beside the engine's own accounting.

`engine.memory_breakdown()` says what the model states *should* take; this says what
the process holds, activations, allocator caches and the framework included. On CUDA
that is the caching allocator's count of live tensor bytes; on CPU, where no allocator
statistics exist, it is the resident set size.
"""

from __future__ import annotations

import os
import resource
import sys

import torch

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
STATM = "/proc/self/statm"


def process_memory(device: torch.device) -> dict[str, int]:
    """Bytes in use now and at the peak so far: {"current", "peak"}."""
    if device.type == "cuda":
        return {
            "current": torch.cuda.memory_allocated(device),
            "peak": torch.cuda.max_memory_allocated(device),
        }
    peak = _peak_rss()
    current = _current_rss() or peak
    # The kernel updates the high-water mark lazily, so it can trail the current size.
    return {"current": current, "peak": max(peak, current)}


def memory_kind(device: torch.device) -> str:
    """What `process_memory` measures on `device`, for labels."""
    return "CUDA allocated" if device.type == "cuda" else "resident set (RSS)"


def _peak_rss() -> int:
    """ru_maxrss is in KiB on Linux and in bytes on macOS."""
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024


def _current_rss() -> int | None:
    """Resident pages from /proc (Linux); None where there is no /proc."""
    try:
        with open(STATM) as file:
            return int(file.read().split()[1]) * PAGE_SIZE
    except OSError:
        return None
