"""Where a rank's stage-3 parameter shards live between gathers (`offload_param.device`).

A gather reads this rank's shard of a unit and all-gathers it into the unit's device
buffer; the optimizer step writes the updated shard back. Three homes, one interface:

    device   the shards stay on the accelerator (plain stage 3)
    cpu      in host memory (ZeRO-Offload of parameters); a gather first copies the shard
             into its place in the device buffer
    nvme     in a private swap file (ZeRO-Infinity, C12): a gather reads the unit's shard
             into a page of host memory (reading the next unit of the trace's direction
             ahead meanwhile), copies it to the device and gives the page back;
             the step rewrites every shard in place, each brought in as it is written
             and the least recently used written out to stay within `buffer_count` x
             `buffer_size` elements, and `flush` writes the rest out, so between steps
             no shard occupies host memory

The home is told what happens to a shard: `shard(unit)` to read it (resident until
`done_reading`), `written(unit)` after writing into it in place.
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import Future

import torch

from shardwise.runtime.accounting import MemoryLedger, tensor_bytes
from shardwise.runtime.zero.swap import Region, SwapError, SwapFile, round_up
from shardwise.runtime.zero.layout import FlatUnit
from shardwise.runtime.zero.policy import OffloadPolicy


class ResidentParamHome:
    """What a home whose shards are always in memory does with the paging calls: nothing."""

    def done_reading(self, unit: FlatUnit) -> None:
        """Resident shards stay where they are."""

    def finish_reads(self) -> None:
        """Nothing is read ahead."""

    def written(self, unit: FlatUnit) -> None:
        """Written in place."""

    def flush(self) -> None:
        """Nothing is paged."""

    def transfers(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        """No files or threads."""


class MemoryParamHome(ResidentParamHome):
    """Shards in device or host memory: always resident, nothing to page."""

    def __init__(self, units: list[FlatUnit], dtype: torch.dtype, device: torch.device, ledger: MemoryLedger,
                 offload: OffloadPolicy):
        self.offloaded = offload.device == "cpu"
        sizes = [unit.chunk_numel for unit in units]
        pin = self.offloaded and offload.pin_memory and torch.cuda.is_available()
        flat = torch.zeros(sum(sizes), dtype=dtype, device="cpu" if self.offloaded else device, pin_memory=pin)
        ledger.hold("params", tensor_bytes(flat), tier="host" if self.offloaded else "device")
        self.shards = dict(zip((unit.index for unit in units), torch.split(flat, sizes)))

    def shard(self, unit: FlatUnit) -> torch.Tensor:
        return self.shards[unit.index]


class NvmeParamHome:
    """Shards in a private swap file under `offload.nvme_path`, paged through host memory.

    Staging is bounded (Cb): at most `buffer_count` x `buffer_size` elements of shards are
    in host memory at once, whatever the model size. Making room writes the least recently
    used shard out (if it changed) and gives its page back; the shard being used and the
    one read ahead are never chosen.
    """

    offloaded = True

    def __init__(self, units: list[FlatUnit], dtype: torch.dtype, ledger: MemoryLedger, offload: OffloadPolicy,
                 rank: int):
        self.swap = SwapFile(offload.nvme_path, rank, offload.thread_count, offload.block_size,
                             offload.queue_depth)
        self.regions: dict[int, Region] = {unit.index: self.swap.region(unit.chunk_numel, dtype) for unit in units}
        buffer = round_up(offload.buffer_size * dtype.itemsize)
        self.capacity = offload.buffer_count * buffer
        # no units when every parameter stays whole (below stage3_param_persistence_threshold)
        largest = max(units, key=lambda unit: unit.chunk_numel, default=None)
        largest_numel = 0 if largest is None else largest.chunk_numel
        if offload.buffer_count < 1 or (largest is not None and self.regions[largest.index].nbytes > buffer):
            self.swap.close()
            raise SwapError(f"offload_param.buffer_count {offload.buffer_count} x buffer_size {offload.buffer_size:,} "
                            f"elements cannot stage the largest parameter shard ({largest_numel:,} elements, "
                            f"{largest}): use buffer_count >= 1 and buffer_size >= {largest_numel:,}")
        self.swap.reserve()
        ledger.hold("params", self.swap.size, tier="nvme")
        self.ledger = ledger
        self._held = 0
        self._ahead: tuple[int, Future] | None = None  # (unit index, its read in flight)
        self._last = -1
        self.resident: dict[int, None] = {}  # in memory now, least recently used first
        self.dirty: set[int] = set()  # resident and changed since last written out
        # never written out: its contents are zeros (a fresh page reads as zeros), no read needed
        self.fresh: set[int] = set(self.regions)

    def shard(self, unit: FlatUnit) -> torch.Tensor:
        """The unit's shard in host memory, valid until the home is next asked for another."""
        index = unit.index
        if self._ahead is not None and self._ahead[0] == index:
            self._ahead[1].result()
            self._ahead = None
        elif index not in self.resident:
            self._finish_read_ahead()
            self._make_room(self.regions[index].nbytes, keep={index})
            self._bring_in(index).result()
        self._touch(index)
        self._read_ahead(index)
        return self.regions[index].tensor

    def _bring_in(self, index: int) -> Future:
        self.resident[index] = None
        self._hold_resident()
        if index in self.fresh:
            done: Future = Future()
            done.set_result(None)
            return done
        return self.swap.read_all([self.regions[index]])

    def _read_ahead(self, index: int) -> None:
        """Gathers walk the units in order, ascending in forward and descending in backward
        (the recorded trace): read the next one in the same direction while this one is
        gathered and used, if it fits beside it."""
        step = index - self._last
        self._last = index
        following = index + step
        if abs(step) != 1 or following not in self.regions or following in self.resident or self._ahead:
            return
        if self._make_room(self.regions[following].nbytes, keep={index, following}):
            self._ahead = (following, self._bring_in(following))

    def _make_room(self, nbytes: int, keep: set[int]) -> bool:
        """Evict least recently used shards until `nbytes` more fit in the staging bound."""
        while self._held + nbytes > self.capacity:
            victim = next((index for index in self.resident if index not in keep), None)
            if victim is None:
                return False
            self._evict(victim)
        return True

    def _evict(self, index: int) -> None:
        if index in self.dirty:
            self.swap.write_all([self.regions[index]]).result()  # gives the page back when written
            self.dirty.discard(index)
            self.fresh.discard(index)
        else:
            self.regions[index].release()
        del self.resident[index]
        self._hold_resident()

    def _touch(self, index: int) -> None:
        self.resident.pop(index, None)
        self.resident[index] = None

    def finish_reads(self) -> None:
        """Wait for a read ahead still in flight: after a backward, the optimizer step may
        write into any shard's page."""
        self._finish_read_ahead()

    def _finish_read_ahead(self) -> None:
        if self._ahead is not None:
            self._ahead[1].result()
            self._ahead = None

    def done_reading(self, unit: FlatUnit) -> None:
        """Give the page back, unless it holds values not yet written out."""
        if unit.index in self.resident and unit.index not in self.dirty and not (
                self._ahead is not None and self._ahead[0] == unit.index):
            self.regions[unit.index].release()
            del self.resident[unit.index]
            self._hold_resident()

    def written(self, unit: FlatUnit) -> None:
        """The shard returned by `shard(unit)` was changed in place. A shard no longer
        resident was written out with its change already (evicted after the write)."""
        if unit.index in self.resident:
            self.dirty.add(unit.index)

    def flush(self) -> None:
        """Write every changed shard out and give its page back. The write completes before
        the step returns: the next step's optimizer writes into the same pages."""
        self._finish_read_ahead()
        if not self.dirty:
            return
        dirty = sorted(self.dirty)
        self.swap.write_all([self.regions[index] for index in dirty]).result()
        for index in dirty:
            del self.resident[index]
        self.fresh.difference_update(dirty)
        self.dirty.clear()
        self._hold_resident()

    def transfers(self) -> dict[str, int]:
        return {"param_nvme_read": self.swap.bytes_read, "param_nvme_write": self.swap.bytes_written}

    def close(self) -> None:
        self._finish_read_ahead()
        self.swap.close()

    def _hold_resident(self) -> None:
        """Count the host bytes of the pages in memory now: the `buffers` peak on the host
        tier is the staging this home used, at most `capacity`."""
        now = sum(self.regions[index].nbytes for index in self.resident)
        if now > self._held:
            self.ledger.hold("buffers", now - self._held, tier="host")
        elif now < self._held:
            self.ledger.release("buffers", self._held - now, tier="host")
        self._held = now


def make_param_home(units: list[FlatUnit], dtype: torch.dtype, device: torch.device, ledger: MemoryLedger,
                    offload: OffloadPolicy, rank: int) -> MemoryParamHome | NvmeParamHome:
    if offload.device == "nvme":
        return NvmeParamHome(units, dtype, ledger, offload, rank)
    return MemoryParamHome(units, dtype, device, ledger, offload)


def merge_transfers(*counts: dict[str, int]) -> dict[str, int]:
    total: Counter = Counter()
    for count in counts:
        total.update(count)
    return dict(total)
