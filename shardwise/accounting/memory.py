"""The engine's own count of the bytes it holds, by category (SPEC §4, C6).

Allocator statistics cannot say *what* memory is for, and on CPU there are none; so every
buffer the engine creates is registered here when allocated and released when freed.
`memory_breakdown()` reports, per category, the most this rank held at once: that is the
number the ZeRO formulas predict, and what a test can check to the byte.
"""

from __future__ import annotations

from collections import Counter

import torch

CATEGORIES = ("params", "grads", "optimizer_states", "buffers")


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class MemoryLedger:
    """Current and peak bytes per category."""

    def __init__(self) -> None:
        self.current: Counter[str] = Counter()
        self.peak: Counter[str] = Counter()

    def hold(self, category: str, nbytes: int) -> None:
        if category not in CATEGORIES:
            raise KeyError(f"unknown memory category {category!r}; expected one of {CATEGORIES}")
        self.current[category] += nbytes
        self.peak[category] = max(self.peak[category], self.current[category])

    def release(self, category: str, nbytes: int) -> None:
        self.current[category] -= nbytes
        if self.current[category] < 0:
            raise RuntimeError(f"memory ledger for {category!r} went negative")

    def set(self, category: str, nbytes: int) -> None:
        """Record that a category now holds exactly `nbytes` (e.g. optimizer state)."""
        self.current[category] = nbytes
        self.peak[category] = max(self.peak[category], nbytes)

    def breakdown(self) -> dict[str, int]:
        return {category: int(self.peak[category]) for category in CATEGORIES}
