"""The opt-in check that data-parallel replicas still hold the same weights.

Replicas start identical (the start-up agreement checks their description; the engine
broadcasts nothing, every rank builds its own copy from the same seed) and stay identical
only as long as every rank applies the same update. A weight edited in place on one rank
after `initialize`, a rank-dependent initialisation the agreement cannot see (same shapes,
other values), or a bit flip make the replicas diverge silently: DDP and DeepSpeed notice
neither. Every `interval` optimizer steps, and before every checkpoint is written, each
rank sums the raw bits of every parameter it holds (as integers, so the sum is exact and
the same on every rank that holds the same bits) and the ranks compare these checksums in
one small exchange; only when one differs are the checksums gathered, to name the first
parameter that differs and the ranks that hold another value than the first replica.
"""

from __future__ import annotations

import torch

from shardwise.runtime.distributed.collectives import Communicator
from shardwise.runtime.reliability.errors import DivergentExecutionError

_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def parameter_checksums(named: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    """One int64 per tensor: the sum of its elements' bits read as integers (exact, and
    changed by any edit short of one that keeps the sum of the bits)."""
    if not named:
        return torch.zeros(0, dtype=torch.int64)
    sums = [tensor.detach().contiguous().view(_BITS[tensor.element_size()]).sum(dtype=torch.int64)
            for _, tensor in named]
    return torch.stack(sums).cpu()


class ReplicaCheck:
    def __init__(self, replicas: Communicator, interval: int):
        """`replicas`: the ranks that hold the same parameters; `interval`: every how many
        optimizer steps (0: only before saves)."""
        self.replicas = replicas
        self.interval = interval

    def due(self, step: int) -> bool:
        return self.interval > 0 and step % self.interval == 0

    def check(self, named: list[tuple[str, torch.Tensor]], when: str) -> None:
        """Raise `DivergentExecutionError` on every rank when some rank's parameters differ."""
        if self.replicas.size == 1:
            return
        mine = parameter_checksums(named)
        both = torch.cat([mine, -mine])
        self.replicas.control_all_reduce(both, f"the replica check {when}", torch.distributed.ReduceOp.MAX)
        highest, lowest = both[:mine.numel()], -both[mine.numel():]
        differs = (highest != lowest).nonzero()
        if differs.numel() == 0:
            return
        first = int(differs[0])
        everyone = torch.zeros(self.replicas.size, dtype=torch.int64)
        self.replicas.all_gather_control(everyone, mine[first:first + 1], "the checksums of the differing parameter")
        members = self.replicas.handle.ranks
        others = [members[r] for r in range(1, self.replicas.size) if everyone[r] != everyone[0]]
        raise DivergentExecutionError(
            f"rank {self.replicas.global_rank}: the replica check {when} found that the data-parallel replicas no "
            f"longer hold the same weights: parameter {named[first][0]} on rank(s) {', '.join(map(str, others))} "
            f"differs from rank {members[0]}'s ({len(differs)} parameter(s) differ in all). Something changed "
            "weights on some ranks only: an in-place edit after initialize (edit on every rank, or before "
            "initialize), a rank-dependent initialisation, or faulty memory."
        )
