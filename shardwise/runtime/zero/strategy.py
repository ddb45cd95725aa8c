"""What differs between ZeRO stages on the parameter side, behind one interface.

Stages 0-2 keep every parameter whole on every rank (`ReplicatedParameters`); stage 3
keeps 1/N of each and gathers on use (`PartitionedParameters`). The engine, the
checkpoint code and `gathered_parameters` talk to this interface only, so none of them
asks which stage is running.

The contract, in the order a training step uses it:

    owned_chunk(unit)     this rank's slice of a unit's parameter values (what the fp32
                          masters are copied from at start-up and back into after a step)
    after_update()        the owned slices changed: make the parameters every rank uses
                          current again (all-gather for stages 1-2, nothing for stage 3)
    end_backward()        a backward finished normally
    abort_pass()          a forward or backward raised: drop whatever it left gathered or
                          in use, so the next step starts clean
    acquire / release     full values of units outside forward (gathered_parameters)
    broadcast_edits       make rank `source`'s edited full values everyone's, re-sharded
    release_gathered()    drop every gathered copy (before a checkpoint load rewrites shards)
    await_readers()       wait until no rank reads the owned chunks any more (before a
                          checkpoint load rewrites them)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from shardwise.runtime.zero.layout import FlatUnit


class ParameterStrategy(ABC):
    units: list[FlatUnit]  # trained: the shard store, reducer and optimizer work on these
    frozen_units: Sequence[FlatUnit] = ()  # held, not trained (stage 3 partitions frozen parameters)

    @abstractmethod
    def owned_chunk(self, unit: FlatUnit) -> torch.Tensor:
        """This rank's chunk of `unit`'s parameter values."""

    @abstractmethod
    def after_update(self) -> None:
        """Bring the parameters every rank computes with up to date with the owned chunks."""

    @abstractmethod
    def acquire(self, units: list[FlatUnit]) -> None:
        """Make the full values of `units` available until `release` (collective)."""

    @abstractmethod
    def release(self, units: list[FlatUnit]) -> None:
        """End one `acquire` of `units`."""

    @abstractmethod
    def broadcast_edits(self, unit: FlatUnit, source: int) -> None:
        """Take group rank `source`'s full values of `unit` as the values on every rank."""

    def settle(self) -> None:
        """The shard store has copied the owned chunks: a paging home may write them out."""

    def transfers(self) -> dict[str, int]:
        """Bytes the parameter shards moved between memory tiers (NVMe paging)."""
        return {}

    def close(self) -> None:
        """Release files and threads (a paging home)."""

    def connect(self, reducer) -> None:
        """Let the gradient reducer tell this strategy when a unit's gradients are done
        (stage 3 frees the unit then)."""

    def end_backward(self) -> None:
        """A backward pass finished normally (stage 3 checks ranks agreed on its gathers)."""

    def abort_pass(self) -> None:
        """A forward or backward raised part-way; forget what it left in use."""

    def release_gathered(self) -> None:
        """Drop every gathered copy; the next use gathers from the (new) shards."""

    def await_readers(self) -> None:
        """Collective: return once no rank reads the owned chunks any more, so they may be
        rewritten (stage 3's shards shared in memory on one host are read in place)."""

    def persistent_numel(self) -> int:
        """Parameters kept whole on every rank although others are partitioned."""
        return 0

    def remove_hooks(self) -> None:
        """Detach from the model (engine.destroy)."""
