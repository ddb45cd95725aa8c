"""Activation bytes, measured with saved-tensor hooks (C6, C9).

Allocator statistics cannot say which bytes are activations (and on CPU there are none),
but autograd can: every tensor kept for backward passes through a saved-tensor pack hook.
The tracker counts three kinds, each at its own peak and together at the joint peak:

    saved        what layers that are not checkpointed keep for backward
    checkpoints  what a checkpointed region keeps between forward and backward: its
                 inputs (a partition of them with Pa, a host copy with CPU checkpointing)
                 and, for selective recomputation, the operator outputs it caches
    recompute    what a region's recomputation brings back for its backward: the
                 working set of recomputation

A tensor is counted by its storage, once however many times it is saved, from the
first save until the last holder is freed (autograd frees a node's saved tensors when
backward has used them, or with the graph). Parameters (and views of them) are model
state, not activations, and are skipped. `memory_breakdown()["activations"]` is the
joint peak; host-memory checkpoints are counted on the "host" tier.
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn

from shardwise.runtime.accounting import MemoryLedger

KINDS = ("saved", "checkpoints", "recompute")
_local = threading.local()


def current_tracker() -> "ActivationTracker | None":
    """The tracker of the forward running on this thread, if any."""
    return getattr(_local, "tracker", None)


def is_parameter(tensor: torch.Tensor) -> bool:
    """A parameter or a view of one (a linear layer saves `weight.t()`)."""
    base = tensor._base if tensor._base is not None else tensor
    return isinstance(base, nn.Parameter)


class ActivationTracker:
    """Current and peak activation bytes of one model (or engine), by kind and tier."""

    def __init__(self, ledger: MemoryLedger | None = None, count_ops: bool = False):
        """`ledger` receives the bytes as category "activations"; `count_ops` counts the
        aten operators each recomputation runs (a dispatch mode: for tests and benchmarks)."""
        self.ledger = ledger
        self.count_ops = count_ops
        self.current: Counter[str] = Counter()
        self.peak: Counter[str] = Counter()
        self.total_peak = 0
        self.device_now = 0
        self.recomputed_regions = 0
        self.recomputed_layers = 0
        self.recomputed_ops = 0
        self._storages: dict[int, list] = {}  # storage id -> [holders, bytes, kind, tier]
        # re-entrant: a holder's finalizer (`_drop`) can run inside `watch`'s locked section
        # when a garbage collection starts there, on this thread; it may also run on a
        # communication thread that drops the last reference to a tensor torch preserved
        self._lock = threading.RLock()

    # -- the forward -----------------------------------------------------------------------
    @contextmanager
    def track(self) -> Iterator["ActivationTracker"]:
        """Count what the enclosed forward saves for backward; checkpointed regions run
        inside report their own checkpoints and recomputations here."""
        previous = current_tracker()
        _local.tracker = self
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack_saved, _unpack):
                yield self
        finally:
            _local.tracker = previous

    def _pack_saved(self, tensor: torch.Tensor) -> torch.Tensor:
        """A parameter is held as it is: it has no autograd history to keep alive, and a
        backward may read its attributes (TRL's chunked log-probability reads ZeRO-3's
        `ds_status` of the head weight it saved), which a detached alias would not have."""
        if isinstance(tensor, nn.Parameter):
            return tensor
        held = tensor.detach()
        if not is_parameter(tensor):
            self.watch(held, "saved")
        return held

    # -- counting ----------------------------------------------------------------------------
    def watch(self, holder: Any, kind: str, tensor: torch.Tensor | None = None, tier: str = "device") -> None:
        """Count `tensor`'s storage (default: `holder`, a tensor) as `kind` until `holder`
        is freed. A storage already counted is only given one more holder."""
        tensor = holder if tensor is None else tensor
        storage = tensor.untyped_storage()
        key = storage._cdata
        with self._lock:
            entry = self._storages.get(key)
            if entry is None:
                entry = self._storages[key] = [0, storage.nbytes(), kind, tier]
                self._hold(kind, entry[1], tier)
            entry[0] += 1
        weakref.finalize(holder, self._drop, key)

    def hold_bytes_now(self, kind: str, nbytes: int, tier: str = "device") -> None:
        """Count `nbytes` that are not one storage of their own (a selective region's
        cached outputs); the caller releases them with `release_bytes_now`."""
        with self._lock:
            self._hold(kind, nbytes, tier)

    def release_bytes_now(self, kind: str, nbytes: int, tier: str = "device") -> None:
        with self._lock:
            self._release(kind, nbytes, tier)

    def _drop(self, key: int) -> None:
        with self._lock:
            entry = self._storages.get(key)
            if entry is None:
                return
            entry[0] -= 1
            if entry[0] == 0:
                del self._storages[key]
                self._release(entry[2], entry[1], entry[3])

    def _hold(self, kind: str, nbytes: int, tier: str) -> None:
        self.current[kind] += nbytes
        self.peak[kind] = max(self.peak[kind], self.current[kind])
        if tier == "device":
            self.device_now += nbytes
            self.total_peak = max(self.total_peak, self.device_now)
        if self.ledger is not None:
            self.ledger.hold("activations", nbytes, tier=tier)

    def _release(self, kind: str, nbytes: int, tier: str) -> None:
        self.current[kind] -= nbytes
        if tier == "device":
            self.device_now -= nbytes
        if self.ledger is not None:
            self.ledger.release("activations", nbytes, tier=tier)

    # -- recomputation ---------------------------------------------------------------------------
    def note_recompute(self, layers: int) -> None:
        self.recomputed_regions += 1
        self.recomputed_layers += layers

    def breakdown(self) -> dict[str, int]:
        """Peak bytes per kind, and `total`: the most held at once on the device."""
        return {**{kind: int(self.peak[kind]) for kind in KINDS}, "total": int(self.total_peak)}

    def reset_peaks(self) -> None:
        """Start measuring peaks from what is held now (e.g. after a warm-up step)."""
        self.peak = Counter(self.current)
        self.total_peak = self.device_now
        self.recomputed_regions = self.recomputed_layers = self.recomputed_ops = 0


def _unpack(held: torch.Tensor) -> torch.Tensor:
    return held
