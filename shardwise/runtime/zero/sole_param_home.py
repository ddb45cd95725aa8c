"""Stage 3 in a shard group of one: the shard is the whole unit, so a gather copies nothing.

With one rank (one GPU running a ZeRO-3 config, or `mics_shard_size` 1), a gather has
nothing to fetch: the unit's only chunk is already on the device.
The copying gather still copied it into the unit's gather buffer, in forward and again in
backward. On the first H100 run (a 3.4B GPT in bf16, four micro-batches of 4096 tokens per
step) stage 3 took 58 ms (8.5%) longer per step than stage 0; those copies move about 27 GB
per micro-batch, some 10 ms at the H100's memory bandwidth, so most of it by their bytes
(an estimate: not yet measured with this home).

This home holds the units in one flat device buffer, each unit's padded values
contiguous, and hands sharded_params.py the interface of shared_param_home.py: each unit
has a second storage over its own memory (made through DLPack, which gives a tensor a new
storage over memory it does not own), which a gather swaps into the unit's gather buffer
and a free swaps back, so the views autograd saved follow as with the shared home. There
are no peers, so publishing, waiting and meeting do nothing.

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

from shardwise.runtime.accounting import MemoryLedger, tensor_bytes
from shardwise.runtime.base.torch_compat import STORAGES_SWAP
from shardwise.runtime.distributed.collectives import Communicator
from shardwise.runtime.zero.layout import FlatUnit
from shardwise.runtime.zero.param_home import ResidentParamHome
from shardwise.runtime.zero.shared_param_home import ENABLE_VARIABLE


class SoleParamHome(ResidentParamHome):
    """A group of one's units in one device buffer; each unit's full values are its shard."""

    offloaded = False

    def __init__(self, units: list[FlatUnit], dtype: torch.dtype, device: torch.device, ledger: MemoryLedger):
        flat = torch.zeros(sum(unit.padded_numel for unit in units), dtype=dtype, device=device)
        ledger.hold("params", tensor_bytes(flat))
        self.fulls = dict(zip((unit.index for unit in units), torch.split(flat, [u.padded_numel for u in units])))
        # the same memory under storages of their own: one is swapped into the gathered unit
        self.storages = {index: torch.from_dlpack(full).untyped_storage() for index, full in self.fulls.items()}

    def shard(self, unit: FlatUnit) -> torch.Tensor:
        return self.fulls[unit.index]

    def full(self, unit: FlatUnit) -> torch.Tensor:
        return self.fulls[unit.index]

    def storage(self, unit: FlatUnit) -> torch.UntypedStorage:
        """A storage over `unit`'s memory, or over nothing while it is swapped into the gathered unit."""
        return self.storages[unit.index]

    def publish(self) -> None:
        """No peer reads this rank's shards."""

    def wait_current(self) -> None:
        """No peer writes shards this rank reads."""

    def meet(self) -> None:
        """No peer to meet."""


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
