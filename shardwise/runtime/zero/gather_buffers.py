"""Spare memory for stage 3's gathered units on the CPU: reused, not reallocated (C4, C10).

A unit's gathered buffer is freed once its module has run and allocated again at its next
gather, twice per step per unit when backward gathers again (`stage3_max_reuse_distance`).
On an accelerator that is cheap: the caching allocator keeps the freed block for the next
request. The CPU has no such allocator: glibc returns a freed block of this size to the
kernel, and the next gather page-faults every page back in (about 1 µs per 4 KiB page;
20,000 faults per step per rank for the 25M GPT, BENCHMARKS.md, "Reusing gathered buffers").

So on the CPU a freed buffer is kept here, by size, and handed to the next unit of that
size. The hand-over swaps the two storages' data pointers: the unit keeps its own storage
object, which the views autograd saved for backward share, so they see the data arrive
exactly as with the `resize_` this replaces (sharded_params.py explains why a unit's
storage is resized in place rather than replaced).

Bounds. Spares plus gathered buffers never exceed the most bytes gathered at once so far:
a gather that finds no spare of its size first drops spares until its buffer fits under
that high-water mark, so the pool adds nothing to the peak. Between passes (after a
backward, a forward without gradients, or a `gathered_parameters` block) it keeps at most
`keep_bytes` (one prefetch bucket): the optimizer step, other engines (an RLHF reference
model), and whatever the user runs between steps, see the memory back. Spares hold no values and are not in the memory ledger, as the
CUDA caching allocator's reserve is not: the ledger counts what the engine uses.
Swapping storages is a private torch API (runtime/base/torch_compat.py probes it); where
it is missing the pool is off and every gather allocates.
"""

from __future__ import annotations

import torch

from shardwise.runtime.base.torch_compat import STORAGES_SWAP


class GatherBuffers:
    """Fills and empties gathered units' storages, keeping freed memory for reuse when
    `reuse` (the CPU) and the torch release can swap storages."""

    def __init__(self, *, reuse: bool, keep_bytes: int):
        self.reuse = reuse and STORAGES_SWAP
        self.keep_bytes = keep_bytes
        self.spares: dict[int, list[torch.UntypedStorage]] = {}  # by size in bytes
        self.spare_bytes = 0
        self.live_bytes = 0  # in storages filled here and not yet emptied
        self.peak_bytes = 0  # the most live at once: spares + live stay under it
        self.fresh_fills = 0  # fills that took new memory from the allocator (after warm-up: none per pass)

    def fill(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Give an empty storage `nbytes` of memory: a spare of that size, or a fresh block."""
        same_size = self.spares.get(nbytes)
        if same_size:
            storage._swap_data_ptr_(same_size.pop())
            self.spare_bytes -= nbytes
        else:
            self._drop_spares_above(max(self.peak_bytes, self.live_bytes + nbytes) - self.live_bytes - nbytes)
            storage.resize_(nbytes)
            self.fresh_fills += 1
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def empty(self, storage: torch.UntypedStorage) -> None:
        """Take a storage's memory away (to the spares, or back to the allocator)."""
        nbytes = storage.nbytes()
        self.live_bytes -= nbytes
        if not self.reuse:
            storage.resize_(0)
            return
        spare = torch.UntypedStorage(0, device=storage.device)
        spare._swap_data_ptr_(storage)
        self.spares.setdefault(nbytes, []).append(spare)
        self.spare_bytes += nbytes

    def end_pass(self) -> None:
        """Between passes: keep at most `keep_bytes` of spares."""
        self._drop_spares_above(self.keep_bytes)

    def release(self) -> None:
        """Return every spare to the allocator (the engine is closing, or the user asked
        for the memory: `empty_partition_cache`)."""
        self._drop_spares_above(0)

    def _drop_spares_above(self, allowed_bytes: int) -> None:
        """Drop spares, largest first, until they hold at most `allowed_bytes`."""
        for nbytes in sorted(self.spares, reverse=True):
            same_size = self.spares[nbytes]
            while same_size and self.spare_bytes > allowed_bytes:
                same_size.pop()
                self.spare_bytes -= nbytes
            if not same_size:
                del self.spares[nbytes]
