"""ZeRO-Infinity's NVMe tier (C12): fp32 masters and optimizer state in a swap file, paged in
one optimizer sub-group at a time.

The gradient partition stays in host memory (fp32, as in the host tier): the optimizer
consumes it sub-group by sub-group. Each sub-group of `sub_group_size` elements is a
*page*: its masters, and the optimizer's per-element state once the optimizer has created
it, each in a region of the swap file (offload/swap.py). Stepping sub-group i reads page
i + 1 ahead and writes page i behind, so the disk works while the CPU updates; at most
three pages are in memory at once (reading, stepping, writing), whatever the model size.

Optimizer state is created by the optimizer in its first step (torch creates it lazily)
or by a checkpoint load; `adopt_state` then copies each per-element state tensor into the
page's region and puts the region's view in its place in the optimizer's state, so from
then on it is paged like the masters.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Iterator

import torch

from shardwise.runtime.zero.host_store import HostGradientStore
from shardwise.runtime.zero.swap import Region, SwapFile
from shardwise.runtime.zero.policy import OffloadPolicy
from shardwise.runtime.zero.shard_store import SegmentState, StoreSpec


@dataclasses.dataclass
class _Page:
    regions: list[Region]  # masters first, then adopted optimizer state
    state: dict[str, Region] = dataclasses.field(default_factory=dict)
    spare: list[Region] = dataclasses.field(default_factory=list)  # reserved for state
    status: str = "in"  # in | out | reading | writing
    io: Future | None = None
    users: int = 0

    @property
    def nbytes(self) -> int:
        return sum(region.nbytes for region in self.regions)


def return_freed_memory() -> None:
    """Give the heap's freed pages back to the operating system (glibc's `malloc_trim`).

    Why: once a freed block of a few MB has raised glibc's mmap threshold, later blocks of
    that size (the state an optimizer creates for one sub-group, freed once copied into
    the page) come from the heap and stay counted in the process's memory after `free`:
    on the 100M GPT, 240 MB of such garbage after the first step, a third of what paging
    the optimizer state saves. Elsewhere (no glibc) nothing is done."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


_LIBC = ctypes.CDLL(ctypes.util.find_library("c")) if ctypes.util.find_library("c") else None
if _LIBC is not None and not hasattr(_LIBC, "malloc_trim"):
    _LIBC = None


class NvmeShardStore(HostGradientStore):
    state_tier = "nvme"

    def __init__(self, spec: StoreSpec, offload: OffloadPolicy, rank: int):
        gradients = self._host_gradients(spec, offload.pin_memory)
        # segments are cut over placeholders (no memory), then their masters become the
        # pages' views, filled from the parameter chunks
        placeholders = [torch.empty(unit.chunk_numel, device="meta") for unit in spec.units]
        self._organise(spec, placeholders, gradients.full, gradients.partition)
        self.param_bytes = spec.param_dtype.itemsize
        self.ledger = spec.ledger
        self.swap = SwapFile(offload.nvme_path, rank, offload.thread_count, offload.block_size,
                             offload.queue_depth)
        self.pages: list[_Page] = []
        segments = []
        for group in self.sub_groups:  # regions first: untouched mappings hold no memory
            numel = sum(segment.numel for segment in group)
            masters = self.swap.region(numel, torch.float32)
            self.pages.append(_Page([masters], spare=[self.swap.region(numel, torch.float32)
                                                      for _ in range(offload.state_tensors)]))
            position = 0
            for segment in group:
                view = masters.tensor[position : position + segment.numel]
                segments.append(dataclasses.replace(segment, master=view))
                position += segment.numel
        self._regroup(segments)
        self.swap.reserve()
        for index, (page, group) in enumerate(zip(self.pages, self.sub_groups)):
            # fill one page and write it out behind the next: a few pages in memory at once
            self.ledger.hold("buffers", page.nbytes, tier="host")
            for segment in group:
                segment.master.copy_(self._param_chunk(segment.unit)[segment.start : segment.stop])
            self._page_out(index)
        self._wait_all()

    def _regroup(self, segments: list[SegmentState]) -> None:
        """Point segments and sub-groups at the pages' master views (same grouping)."""
        by_old = dict(zip((id(s) for s in self.segments), segments))
        self.segments = segments
        self.sub_groups = [[by_old[id(s)] for s in group] for group in self.sub_groups]
        self._sub_group_index = {id(s): i for i, group in enumerate(self.sub_groups) for s in group}

    # -- paging ------------------------------------------------------------------------------------
    @contextmanager
    def resident(self, sub_group: list[SegmentState]) -> Iterator[list[SegmentState]]:
        if not sub_group:
            yield sub_group
            return
        index = self._sub_group_index[id(sub_group[0])]
        page = self.pages[index]
        self.settle(sub_group)
        self._page_in(index)
        page.users += 1
        if index + 1 < len(self.pages):
            self._start_read(index + 1)  # read ahead while this one is used
        try:
            yield sub_group
        finally:
            page.users -= 1
            if page.users == 0:
                self._page_out(index)  # write behind

    def _start_read(self, index: int) -> None:
        page = self.pages[index]
        if page.status == "writing":
            self._finish(page)
        if page.status == "out":
            self.ledger.hold("buffers", page.nbytes, tier="host")
            page.io = self.swap.read_all(page.regions)
            page.status = "reading"

    def _page_in(self, index: int) -> None:
        self._start_read(index)
        self._finish(self.pages[index])
        for other, page in enumerate(self.pages):  # a read-ahead nobody used
            if other not in (index, index + 1) and page.status in ("in", "reading") and not page.users:
                self._page_out(other)

    def _page_out(self, index: int) -> None:
        page = self.pages[index]
        if page.status in ("reading",):
            self._finish(page)
        if page.status != "in":
            return
        page.io = self.swap.write_all(page.regions)
        page.status = "writing"
        writing = [p for p in self.pages if p.status == "writing"]
        if len(writing) > 1:  # keep at most one page in flight behind
            self._finish(writing[0] if writing[0] is not page else writing[1])

    def _finish(self, page: _Page) -> None:
        if page.io is not None:
            page.io.result()
            page.io = None
        if page.status == "reading":
            page.status = "in"
        elif page.status == "writing":
            page.status = "out"
            self.ledger.release("buffers", page.nbytes, tier="host")

    def _wait_all(self) -> None:
        for page in self.pages:
            if page.status == "writing":
                self._finish(page)

    # -- optimizer state -----------------------------------------------------------------------------
    def adopt_state(self, sub_group: list[SegmentState], state: dict) -> None:
        """Move the per-element state the optimizer holds for `sub_group` into the page."""
        if not sub_group:
            return
        page = self.pages[self._sub_group_index[id(sub_group[0])]]
        position, moved = 0, False
        for segment in sub_group:
            values = state.get(segment.master, {})
            for key, value in list(values.items()):
                if not (torch.is_tensor(value) and value.dim() == 1 and value.numel() == segment.numel):
                    continue
                region = self._state_region(page, key, value.dtype, sum(s.numel for s in sub_group))
                view = region.tensor[position : position + segment.numel]
                if view.data_ptr() != value.data_ptr():
                    view.copy_(value)
                    values[key] = view
                    moved = True
            position += segment.numel
        if moved:  # the optimizer's own copies are freed now
            return_freed_memory()

    def _state_region(self, page: _Page, key: str, dtype: torch.dtype, numel: int) -> Region:
        if key not in page.state:
            spare = next((r for r in page.spare if r.tensor.dtype == dtype), None)
            if spare is not None:
                page.spare.remove(spare)
            else:  # more state than the optimizer's entry announced: grow the file
                spare = self.swap.region(numel, dtype)
                self.swap.reserve()
            self.ledger.hold("buffers", spare.nbytes, tier="host")  # the page is in memory now
            page.state[key] = spare
            page.regions.append(spare)
        return page.state[key]

    # -- gradients: in host memory, as in the host tier (HostGradientStore) -----------------------
    def publish(self, sub_group=None) -> None:
        if sub_group is not None:
            self.moved["host_to_device"] += sum(s.numel for s in sub_group) * self.param_bytes
        super().publish(sub_group)

    def transfers(self) -> dict[str, int]:
        return {**self.moved, "nvme_read": self.swap.bytes_read, "nvme_write": self.swap.bytes_written}

    def master_bytes(self) -> int:
        return sum(page.regions[0].numel * 4 for page in self.pages)

    def close(self) -> None:
        self._wait_all()
        self.swap.close()
