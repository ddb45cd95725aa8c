"""The engine's own count of the bytes it holds, by category and memory tier (docs/formulas.md#model-states-per-rank, C6).

Allocator statistics cannot say *what* memory is for, and on CPU there are none; so every
buffer the engine creates is registered here when allocated and released when freed.
`memory_breakdown()` reports, per category, the most this rank held at once: that is the
number the ZeRO formulas predict, and what a test can check to the byte.

A tier says where the bytes live: "device" (the accelerator, or the CPU when there is
none), "host" (CPU memory next to an accelerator: ZeRO-Offload) or "nvme" (swap files:
ZeRO-Infinity). Offloading moves a category's bytes from one tier to another, and the
formulas say how many land in each.

"activations" are the bytes autograd keeps for backward (shardwise/runtime/activation/accounting.py
measures them with saved-tensor hooks): not model states, but the other large consumer
that recomputation trades for compute.
"""

from __future__ import annotations

from collections import Counter

import torch

CATEGORIES = ("params", "grads", "optimizer_states", "buffers", "activations")
TIERS = ("device", "host", "nvme")


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class MemoryLedger:
    """Current and peak bytes per (tier, category)."""

    def __init__(self) -> None:
        self.current: Counter[tuple[str, str]] = Counter()
        self.peak: Counter[tuple[str, str]] = Counter()

    def _key(self, category: str, tier: str) -> tuple[str, str]:
        if category not in CATEGORIES:
            raise KeyError(f"unknown memory category {category!r}; expected one of {CATEGORIES}")
        if tier not in TIERS:
            raise KeyError(f"unknown memory tier {tier!r}; expected one of {TIERS}")
        return tier, category

    def hold(self, category: str, nbytes: int, tier: str = "device") -> None:
        key = self._key(category, tier)
        self.current[key] += nbytes
        self.peak[key] = max(self.peak[key], self.current[key])

    def release(self, category: str, nbytes: int, tier: str = "device") -> None:
        key = self._key(category, tier)
        self.current[key] -= nbytes
        if self.current[key] < 0:
            raise RuntimeError(f"memory ledger for {category!r} on {tier!r} went negative")

    def set(self, category: str, nbytes: int, tier: str = "device") -> None:
        """Record that a category now holds exactly `nbytes` (e.g. optimizer state)."""
        key = self._key(category, tier)
        self.current[key] = nbytes
        self.peak[key] = max(self.peak[key], nbytes)

    def breakdown(self, tier: str = "device") -> dict[str, int]:
        return {category: int(self.peak[(tier, category)]) for category in CATEGORIES}

    def breakdown_by_tier(self) -> dict[str, dict[str, int]]:
        """Every tier that holds anything, with its peak bytes per category."""
        return {tier: self.breakdown(tier) for tier in TIERS
                if tier == "device" or any(self.peak[(tier, category)] for category in CATEGORIES)}
