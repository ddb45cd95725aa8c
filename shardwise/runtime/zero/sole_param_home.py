"""Stage 3 in a shard group of one: the shard is the whole unit, so a gather copies nothing.

With one rank (one GPU running a ZeRO-3 config, or `mics_shard_size` 1), a gather has
nothing to fetch: the unit's only chunk is already on the device.
The copying gather still copied it into the unit's gather buffer, in forward and again in
backward. On the first H100 run (a 3.4B GPT in bf16, four micro-batches of 4096 tokens per
step) stage 3 took 58 ms (8.5%) longer per step than stage 0; those copies move about 27 GB
per micro-batch, some 10 ms at the H100's memory bandwidth, so most of it by their bytes
(an estimate: not yet measured with this home: the GPU machine's torch, 2.11, has no
storage swaps, so there the gathers still copy; its H200 run of 2026-11-28 measured stage
3 at +4.0% eager and +2.3% compiled over stage 0 with them, BENCHMARKS.md).

This home is shared_param_home.py's over a region of this process's own device memory
instead of one shared by a host's ranks: the units laid out unit by unit, each unit's
shard its whole full buffer, and a gather swapping the unit's memory into its gather
buffer (the region hands out each piece under a storage of its own, made through DLPack,
which gives a tensor a new storage over memory it does not own), so the views autograd
saved follow as with the shared home. There are no peers, so publishing, waiting and
meeting do nothing.

It applies where the group skips its collectives (one rank, without the test-only switch
that makes a world of one issue them), parameters are not offloaded and neither of
ZeRO++'s qwZ and hpZ is on (sharded_params.py checks those), the torch release can swap
storages and DLPack gives a storage of its own (both probed), and
`SHARDWISE_SHARED_PARAMETERS` is not "0" (shared_param_home.py's switch, which turns both
homes off: tests and benchmarks compare them with the copying gathers). Otherwise the
gathers copy.
"""

from __future__ import annotations

import functools
import os

import torch

from shardwise.runtime.accounting import MemoryLedger
from shardwise.runtime.base.torch_compat import STORAGES_SWAP
from shardwise.runtime.distributed.collectives import Communicator
from shardwise.runtime.zero.layout import FlatUnit
from shardwise.runtime.zero.shared_param_home import ENABLE_VARIABLE, SharedParamHome, unit_offsets


class PrivateRegion:
    """One process's device memory with a shared region's interface (distributed/shared_region.py)."""

    def __init__(self, nbytes: int, device: torch.device):
        self.data = torch.zeros(nbytes, dtype=torch.uint8, device=device)

    def tensor(self, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """`numel` elements of `dtype` at byte `offset`, a storage of their own over the same memory."""
        piece = self.data[offset : offset + numel * dtype.itemsize]
        return torch.from_dlpack(piece).view(dtype)

    def publish(self) -> None:
        """No peer reads this process's shards."""

    def wait_current(self) -> None:
        """No peer writes shards this process reads."""

    def meet(self) -> None:
        """No peer to meet."""


class SoleParamHome(SharedParamHome):
    """A group of one's units in one device buffer; each unit's full values are its shard."""

    def __init__(self, units: list[FlatUnit], dtype: torch.dtype, device: torch.device, ledger: MemoryLedger):
        offsets, total = unit_offsets(units, dtype)
        super().__init__(units, dtype, PrivateRegion(total, device), 0, offsets, ledger)


def sole_param_home(units: list[FlatUnit], dtype: torch.dtype, device: torch.device, comm: Communicator,
                    ledger: MemoryLedger) -> SoleParamHome | None:
    """The home of a group that skips its collectives, where this torch allows it (module
    docstring); None otherwise. The caller has ruled out offloading and ZeRO++'s gathers."""
    if not (comm.skips_collectives and units and STORAGES_SWAP and os.environ.get(ENABLE_VARIABLE, "1") != "0"
            and _dlpack_gives_a_storage_of_its_own(torch.device(device))):
        return None
    return SoleParamHome(units, dtype, device, ledger)


@functools.cache
def _dlpack_gives_a_storage_of_its_own(device: torch.device) -> bool:
    """Whether `torch.from_dlpack` of a tensor on `device` gives a second storage over the
    same memory (were it the same storage, swapping it out would empty the shard too)."""
    tensor = torch.zeros(2, device=device)
    alias = torch.from_dlpack(tensor)
    return alias.data_ptr() == tensor.data_ptr() and alias.untyped_storage()._cdata != tensor.untyped_storage()._cdata
