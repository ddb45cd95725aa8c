"""Parameters in stage 3: each rank stores 1/N of every unit and gathers on use (C4).

Each unit owns one flat buffer for its gathered parameters, whose *storage* is allocated
only while the unit is gathered (resized to zero bytes otherwise). Freeing the storage in
place, rather than dropping the tensor, is what actually returns the memory: autograd
keeps views of gathered weights for backward (a linear layer saves `weight.t()`), and a
view holds its storage alive. When backward needs the unit again, it is gathered back
into the same storage, so those saved views read valid weights again. On the CPU the freed
memory itself is kept for the next gather of that size (gather_buffers.py).

Outside a gather each parameter's `.data` is an empty tensor, so user code that touches
a released parameter fails with a shape error instead of reading freed memory.

Gathers are asynchronous: `fetch` starts one, `wait` finishes it. A reference count per
unit lets nested users (a module and `gathered_parameters`) share one gather.

ZeRO++ (C28) changes where a gather reads from and what it carries:

- qwZ (`quantized_weights`): the training pass's gathers carry int8 blocks
  (distributed/quantized_collectives.py), so forward and backward compute with the
  dequantized values; `gathered_parameters` (`exact=True`) gathers the values themselves,
  for code that reads or saves weights.
- hpZ (`secondary`, the secondary partition group inside the node): each rank also holds
  1/H of every unit, copied out of the full buffer when a gather from the primary shards
  arrives. Until the next update (or an edit of the unit) a gather reads the secondary
  partitions over the node's H ranks instead: backward's gathers, and any second forward
  use, cross no node boundary. The secondary holds what the pass computed with (with qwZ,
  the dequantized values, sent as they are inside the node), so backward sees exactly
  forward's weights. It costs pΨ/H bytes per rank (docs/formulas.md#hpz-secondary-partition),
  counted under "params".

On one host (CPU ranks of a gloo group sharing /dev/shm, parameters not offloaded, neither
qwZ nor hpZ) the home is shared_param_home.py's: every unit's full buffer once per host,
each rank's shard a view of its chunk there. A gather then copies nothing: it waits until
every peer has published its latest shards and points the unit's storage at the unit's
shared memory; `free` points it back at nothing. Where that does not fit, a gather copies
as above. Code outside the pass that may write into what it gathered (`acquire`:
`gathered_parameters`, the final weights) gets a private copy instead, taken from the
shared memory without a collective (a unit the pass has gathered is copied in place, its
storage keeping its identity), so its edits stay its own until `broadcast_edits`
re-shards them, as with a copying gather. Writes into the shards meet the peers first
(`await_readers`: the end of each backward, before a checkpoint load rewrites shards,
before `take_shard_from_full`). A rank publishes its shards at its next gather, as a
copying gather sends them only when its rank gathers too: whatever the rank wrote before
it (the step, a load, an edit, DeepSpeed's `safe_set_*` between steps) is what its peers
read.

A shard group of one (one rank, on any device) gathers the same way over
sole_param_home.py's buffer: its shard is the whole unit, so a gather points the unit at
it instead of copying it.
"""

from __future__ import annotations

import time

import torch

from shardwise.runtime.accounting import MemoryLedger, tensor_bytes
from shardwise.runtime.distributed.collectives import Communicator, PendingCollective
from shardwise.runtime.distributed.quantized_collectives import QuantizedAllGather
from shardwise.runtime.zero.gather_buffers import GatherBuffers
from shardwise.runtime.zero.param_home import NvmeParamHome, make_param_home
from shardwise.runtime.zero.shared_param_home import SharedParamHome, shared_param_home
from shardwise.runtime.zero.sole_param_home import sole_param_home
from shardwise.runtime.zero.layout import FlatUnit
from shardwise.runtime.zero.policy import OffloadPolicy, ZeroPlusPlusPolicy


class ShardedParameters:
    def __init__(
        self,
        units: list[FlatUnit],
        dtype: torch.dtype,
        device: torch.device,
        comm: Communicator,
        ledger: MemoryLedger,
        home: OffloadPolicy = OffloadPolicy(),
        plus_plus: ZeroPlusPlusPolicy = ZeroPlusPlusPolicy(),
        secondary: Communicator | None = None,
        spare_bytes_between_passes: int = 0,
    ):
        """`comm`: the shard group; chunk r of every unit lives on its rank r. `home`:
        where the shards live between gathers (`offload_param`: the device, host memory
        or NVMe; offload/param_home.py); an offloaded shard is first copied into its
        place in the gathered buffer. `plus_plus`, `secondary`: ZeRO++'s quantized
        gathers and hpZ's secondary partition group (see above). `spare_bytes_between_passes`:
        freed gather memory kept for the next pass on the CPU (gather_buffers.py)."""
        self.units = units
        self.dtype = dtype
        self.device = device
        self.comm = comm
        self.ledger = ledger
        self.weight_block = plus_plus.weight_block if plus_plus.quantized_weights else None
        self.secondary = secondary if plus_plus.hpz_partition_size > 1 and secondary is not None else None
        shared = None
        if home.device == "none" and self.weight_block is None and self.secondary is None:
            shared = shared_param_home(units, dtype, device, comm, ledger) or sole_param_home(
                units, dtype, device, comm, ledger)
        self.shared: SharedParamHome | None = shared
        self.home = shared or make_param_home(units, dtype, device, ledger, home, comm.rank)
        self.private: set[int] = set()  # gathered units holding a private copy (`acquire`) over shared memory
        self.offloaded = self.home.offloaded
        self.flats: dict[int, torch.Tensor] = {}
        self.buffers = GatherBuffers(reuse=device.type == "cpu", keep_bytes=spare_bytes_between_passes)
        self.views: dict[int, list[torch.Tensor]] = {}
        for unit in units:
            flat = torch.empty(unit.padded_numel, dtype=dtype, device=device)
            self.views[unit.index] = [
                flat[slot.offset : slot.offset + slot.numel].view(slot.shape) for slot in unit.slots
            ]
            flat.untyped_storage().resize_(0)
            self.flats[unit.index] = flat
        self.gathered: set[int] = set()
        self._gathered_numel = 0  # of the units in `gathered`, kept as they come and go: read on every use
        self.pending: dict[int, PendingCollective] = {}
        self.users: dict[int, int] = {}
        self.peak_gathered_numel = 0
        self.empty = torch.empty(0, dtype=dtype, device=device)
        self.secondary_views: dict[int, torch.Tensor] = {}
        self.secondary_current: set[int] = set()  # units whose secondary partition holds the current values
        self._fills_secondary: set[int] = set()  # gathers in flight whose result refreshes it
        if self.secondary is not None:
            sizes = [unit.padded_numel // self.secondary.size for unit in units]
            self.secondary_flat = torch.empty(sum(sizes), dtype=dtype, device=device)
            ledger.hold("params", tensor_bytes(self.secondary_flat))
            self.secondary_views = dict(zip((unit.index for unit in units), torch.split(self.secondary_flat, sizes)))

    # -- building the shards -------------------------------------------------------------
    def take_shard_from_full(self, unit: FlatUnit) -> None:
        """Copy this rank's chunk out of the parameters' current full values, then release.

        Used once at start-up (every rank holds the same full weights: the model was
        broadcast or initialised identically) and by `gathered_parameters` after edits.
        Over shared memory the ranks meet first (a peer may still copy the old values,
        `acquire`).
        """
        if self.shared is not None:
            self.await_readers(f"re-sharding {unit}")
        shard = self.home.shard(unit)
        with torch.no_grad():
            for piece in unit.owned_pieces(self.comm.rank):
                source = piece.slot.param.detach().reshape(-1)[piece.start : piece.stop]
                shard[piece.chunk_offset : piece.chunk_offset + piece.numel].copy_(source)
        self.home.written(unit)
        self.secondary_current.discard(unit.index)
        if unit.index not in self.gathered:
            for slot in unit.slots:
                slot.param.data = self.empty

    def owned_chunk(self, unit: FlatUnit) -> torch.Tensor:
        """The shard, resident until the next `flush` (the step writes into it in place)."""
        shard = self.home.shard(unit)
        self.home.written(unit)
        return shard

    def flush(self, rewritten: bool = False) -> None:
        """Let the home write changed shards out; `rewritten`: a step or a load wrote every
        owned shard in place (through `owned_chunk`'s tensors)."""
        if rewritten:
            for unit in self.units:
                self.home.written(unit)
            self.secondary_current.clear()  # the parameters changed: the next gather reads the primary shards
        self.home.flush()

    def await_readers(self, what: str) -> None:
        """Over shared memory: return once every rank has arrived here, so none still reads
        the shards about to be rewritten (nothing to wait for otherwise)."""
        if self.shared is not None:
            self._checked(self.shared.meet, "barrier",
                          f"{what}: waiting for every rank's reads of the shared parameters")

    # -- gather / release ----------------------------------------------------------------
    def is_available(self, unit: FlatUnit) -> bool:
        """Gathered or being gathered."""
        return unit.index in self.gathered or unit.index in self.pending

    def fetch(self, unit: FlatUnit, exact: bool = False) -> None:
        """Start gathering `unit` unless it is already gathered or in flight. `exact`: the
        values themselves, never qwZ's quantized ones (gathered_parameters)."""
        if self.is_available(unit):
            return
        flat = self.flats[unit.index]
        if self.shared is not None:
            self.shared.publish()  # this rank's writes since the last meeting are done: peers may read them
            self._checked(self.shared.wait_current, "all_gather", f"parameters of {unit} (shared memory)")
            self.comm.count_in_place("all_gather", tensor_bytes(flat))
            if exact:
                self._copy_shared(unit)
            else:
                flat.untyped_storage()._swap_data_ptr_(self.shared.storage(unit))
        else:
            self.buffers.fill(flat.untyped_storage(), tensor_bytes(flat))
        self.ledger.hold("buffers", tensor_bytes(flat))
        self.gathered.add(unit.index)
        self._gathered_numel += flat.numel()
        self.peak_gathered_numel = max(self.peak_gathered_numel, self._gathered_numel)
        if self.shared is not None:
            self._point_params(unit)
            return
        what = f"parameters of {unit}"
        quantized = self.weight_block is not None and not exact
        if unit.index in self.secondary_current and (quantized or self.weight_block is None):
            self.pending[unit.index] = self.secondary.all_gather(flat, self.secondary_views[unit.index],
                                                                 f"{what} (hpZ secondary partition)")
            return
        shard = self.home.shard(unit)
        if self.offloaded:  # host -> this rank's place in the device buffer, then gather in place
            lo, hi = unit.chunk_bounds(self.comm.rank)
            shard = flat[lo:hi].copy_(shard, non_blocking=not isinstance(self.home, NvmeParamHome))
            self.home.done_reading(unit)
        if self.secondary is not None and (quantized or self.weight_block is None):
            self._fills_secondary.add(unit.index)
        if quantized:
            self.pending[unit.index] = QuantizedAllGather(self.comm, flat, shard, block=self.weight_block, what=what,
                                                          ledger=self.ledger)
        else:
            self.pending[unit.index] = self.comm.all_gather(flat, shard, what)

    def wait(self, unit: FlatUnit) -> None:
        """Finish the gather of `unit` and point its parameters at the result."""
        pending = self.pending.pop(unit.index, None)
        if pending is None:
            return
        pending.wait()
        if unit.index in self._fills_secondary:
            self._fills_secondary.discard(unit.index)
            secondary = self.secondary_views[unit.index]
            start = self.secondary.rank * secondary.numel()
            secondary.copy_(self.flats[unit.index][start : start + secondary.numel()])
            self.secondary_current.add(unit.index)
        self._point_params(unit)

    def _point_params(self, unit: FlatUnit) -> None:
        for slot, view in zip(unit.slots, self.views[unit.index]):
            slot.param.data = view

    def _copy_shared(self, unit: FlatUnit) -> None:
        """Give `unit`'s (empty) storage private memory holding the shared values."""
        flat = self.flats[unit.index]
        self.buffers.fill(flat.untyped_storage(), tensor_bytes(flat))
        flat.copy_(self.shared.full(unit))
        self.private.add(unit.index)

    def _checked(self, wait, op: str, what: str) -> None:
        """Run a shared-memory wait; its failure names this rank, `op` on `what` and the group."""
        started = time.monotonic()
        try:
            wait()
        except RuntimeError as error:
            raise self.comm.error(op, what, error, started) from error

    def acquire(self, unit: FlatUnit) -> None:
        """Full values of `unit` for code outside the pass (exact, even under qwZ). Over
        shared memory, a private copy: what the caller writes stays its own."""
        if self.shared is not None and unit.index in self.gathered and unit.index not in self.private:
            self.flats[unit.index].untyped_storage()._swap_data_ptr_(self.shared.storage(unit))
            self._copy_shared(unit)
        self.fetch(unit, exact=True)
        self.wait(unit)
        self.users[unit.index] = self.users.get(unit.index, 0) + 1

    def release_use(self, unit: FlatUnit) -> int:
        """Drop one user; returns how many remain."""
        remaining = self.users.get(unit.index, 0) - 1
        if remaining <= 0:
            self.users.pop(unit.index, None)
            return 0
        self.users[unit.index] = remaining
        return remaining

    def free(self, unit: FlatUnit) -> None:
        """Drop the gathered copy (waiting first if it is still in flight)."""
        if unit.index not in self.gathered:
            return
        self.wait(unit)
        self.gathered.discard(unit.index)
        self.users.pop(unit.index, None)
        for slot in unit.slots:
            slot.param.data = self.empty
        flat = self.flats[unit.index]
        self._gathered_numel -= flat.numel()
        self.ledger.release("buffers", tensor_bytes(flat))
        if self.shared is not None and unit.index not in self.private:
            flat.untyped_storage()._swap_data_ptr_(self.shared.storage(unit))
        else:
            self.private.discard(unit.index)
            self.buffers.empty(flat.untyped_storage())

    def gathered_numel(self) -> int:
        return self._gathered_numel

    def full_buffer(self, unit: FlatUnit) -> torch.Tensor:
        """The gathered flat buffer of `unit` (only valid while it is gathered)."""
        if unit.index not in self.gathered:
            raise RuntimeError(f"{unit} is not gathered")
        self.wait(unit)
        return self.flats[unit.index]
