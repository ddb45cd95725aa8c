"""Stage 3's parameters on one host: every unit's full flat buffer once per host, shared by
the ranks of the shard group, so a gather copies nothing (issue 27 item 2).

On the CPU, ranks of one host gathering through the shared-memory transport still copy
each unit twice per gather: every rank copies its shard into the transport's segment, and
every rank copies the whole unit out into its own buffer (page faults and buffer
management besides). Yet the ranks could read each other's shards where they lie. This
home keeps the units in one shared region (distributed/shared_region.py), laid out unit
by unit, each unit's padded full flat buffer contiguous (64-byte aligned) with rank r's
chunk at its usual chunk bounds inside it. A rank's shard (`shard(unit)`, what the
optimizer writes in place) is a view of its chunk there; a gather points the unit's flat
buffer at the unit's region (sharded_params.py swaps the storages' data pointers, so the
views autograd saved for backward follow), and a free points it back at nothing.

What replaces the copy is ordering (sharded_params.py drives it):

- a rank `meet`s the others before it writes (at the end of each backward, before a
  checkpoint load, before re-sharding an edit), so it never overwrites values a peer's
  pass is still reading: forward and backward of one step see the same weights on every
  rank, and a peer still in its backward never sees another rank's new values;
- a rank `publish`es its shards at its first gather after a meeting (its version becomes
  the number of that meeting), so whatever it wrote before (a step, a load, an edit, the
  start-up's `take_shard_from_full`, DeepSpeed's `safe_set_*` between steps) is included,
  as a copying gather sends a rank's shard only when that rank gathers too; a gather then
  waits until every peer has published at least this rank's version, so it reads the
  values the copying gather would have received.

A wait spins, then sleeps on a futex, checks the peer's process still exists every 0.1 s
and gives up at the collective timeout, failing with the peer named.

When it applies: the shard group's ranks all run on this host (what the transport checks:
same host name and boot id; gloo), the device is the CPU, parameters are not offloaded
(`offload_param` none), neither of ZeRO++'s qwZ and hpZ is on (their gathers carry other
values than the shards), the torch release can swap storages, the C loops build, /dev/shm
holds the model, `SHARDWISE_SHARED_MEMORY` is not "0" (the transport's switch, which turns
both off) and `SHARDWISE_SHARED_PARAMETERS` is not "0" (this home alone: gathers copy
through the transport, as before it; tests and benchmarks compare the two).
Otherwise sharded_params.py keeps its own copying gathers (MemoryParamHome/NvmeParamHome).
16-bit parameters share their 16-bit values: the step updates the fp32 master, then writes
the 16-bit shard, published at the next gather.

Not covered (the copying gathers' private buffers made these harmless): a module that
writes into its own weights in place during its forward now writes every rank's; a write
into the shards after this rank's gathers of a pass and before the next meeting (a step
after a forward-only pass, a `safe_set_*` during a pass) may be read by a peer's pass.

Memory. The ledger counts what each rank uses, as the formulas say
(docs/formulas.md): its shard under "params" and, while a unit is gathered, the unit's
full bytes under "buffers". Physically the host holds one full copy of the partitioned
parameters in the region, shared by the ranks, and no gather buffers: lower than the sum
of the ranks' ledgers (N shards plus N gather working sets).
"""

from __future__ import annotations

import os

import torch

from shardwise.runtime.accounting import MemoryLedger
from shardwise.runtime.base.torch_compat import STORAGES_SWAP
from shardwise.runtime.distributed import shared_memory
from shardwise.runtime.distributed.collectives import Communicator
from shardwise.runtime.distributed.setup import collective_timeout
from shardwise.runtime.distributed.shared_region import SharedRegion, connect_region
from shardwise.runtime.zero.layout import FlatUnit
from shardwise.runtime.zero.param_home import ResidentParamHome

ENABLE_VARIABLE = "SHARDWISE_SHARED_PARAMETERS"
_ALIGN = 64


class SharedParamHome(ResidentParamHome):
    """The units' full buffers in a region shared by the shard group's ranks on one host."""

    offloaded = False

    def __init__(self, units: list[FlatUnit], dtype: torch.dtype, region: SharedRegion, rank: int,
                 offsets: dict[int, int], ledger: MemoryLedger):
        self.region = region
        self.fulls: dict[int, torch.Tensor] = {}  # each unit's full flat, over the region
        self.storages: dict[int, torch.UntypedStorage] = {}  # the same memory, swapped into a gathered unit
        self.shards: dict[int, torch.Tensor] = {}
        for unit in units:
            full = region.tensor(offsets[unit.index], unit.padded_numel, dtype)
            self.fulls[unit.index] = full
            self.storages[unit.index] = region.tensor(offsets[unit.index], unit.padded_numel, dtype).untyped_storage()
            lo, hi = unit.chunk_bounds(rank)
            self.shards[unit.index] = full[lo:hi]
        ledger.hold("params", sum(unit.chunk_numel for unit in units) * dtype.itemsize)

    def shard(self, unit: FlatUnit) -> torch.Tensor:
        return self.shards[unit.index]

    def full(self, unit: FlatUnit) -> torch.Tensor:
        """Every rank's current values of `unit` (read after `wait_current`)."""
        return self.fulls[unit.index]

    def storage(self, unit: FlatUnit) -> torch.UntypedStorage:
        """A storage over `unit`'s region, or over nothing while its memory is swapped into
        the gathered unit."""
        return self.storages[unit.index]

    def publish(self) -> None:
        self.region.publish()

    def wait_current(self) -> None:
        self.region.wait_current()

    def meet(self) -> None:
        self.region.meet()

    def close(self) -> None:
        """The mapping goes when the last tensor over it does."""


def shared_param_home(units: list[FlatUnit], dtype: torch.dtype, device: torch.device, comm: Communicator,
                      ledger: MemoryLedger) -> SharedParamHome | None:
    """The shared home when the group and device allow it (module docstring), else None
    on every rank alike. The caller has ruled out offloading and ZeRO++'s gathers."""
    if not (device.type == "cpu" and STORAGES_SWAP and comm.point_to_point and comm.control_group is not None
            and shared_memory.enabled() and os.environ.get(ENABLE_VARIABLE, "1") != "0" and units):
        return None
    offsets, total = unit_offsets(units, dtype)
    region = connect_region(total, rank=comm.rank, global_ranks=comm.handle.ranks, timeout=collective_timeout(),
                            gather=lambda value: comm.control_all_gather_object(value, counted=False))
    if region is None:
        return None
    return SharedParamHome(units, dtype, region, comm.rank, offsets, ledger)


def unit_offsets(units: list[FlatUnit], dtype: torch.dtype) -> tuple[dict[int, int], int]:
    """Each unit's byte offset in a region laid out unit by unit (each 64-byte aligned), and
    the region's size."""
    offsets: dict[int, int] = {}
    total = 0
    for unit in units:
        offsets[unit.index] = total
        total += -(-unit.padded_numel * dtype.itemsize // _ALIGN) * _ALIGN
    return offsets, total
