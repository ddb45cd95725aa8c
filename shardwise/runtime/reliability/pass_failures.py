"""A forward or backward that raises on some ranks of a tensor- or sequence-parallel
group: one named error on every rank at once, not a wait until the collective timeout.

With data parallelism alone, a rank whose forward raised can skip the batch: its peers'
forwards need nothing from it, and the step check (step_guard.py) names the difference
at the next step. Inside a tensor- or sequence-parallel group the peers' forward cannot
finish without it: they wait in the collectives of the rest of that forward, until the
process group's timeout ends them with gloo's "Timed out waiting". Worse, if the raising
rank skipped to its next batch, its collectives would pair with the ones its peers are
still waiting in, and both would compute on the other's activations.

So, in an engine with such a group, every rank counts its forward passes alike, and:
- a rank whose forward or backward raises notes it in the c10d store (the pass and the
  error), then waits for each peer of its groups to note the same pass (every rank
  raised alike: the pass may be skipped, as with data parallelism) or that it stopped;
- a rank blocked in a collective (distributed/blocked_waits.py) reads its group's
  notes: a peer that raised in a pass this rank did not raise in will never come, so it
  notes that it stops, and raises `PassDivergedError` naming the peer and its error;
- the raising rank, told that a peer stopped, raises the same error, chained to its own.
Every rank ends with a `DivergentExecutionError` that says "raised on some ranks only".
"""

from __future__ import annotations

import json
import time
from itertools import count
from typing import Iterable

import torch.distributed as dist

from shardwise.runtime.distributed.blocked_waits import AbandonedWait
from shardwise.runtime.reliability.errors import DivergentExecutionError

_ENGINES = count()  # engines with such a group in this process: every rank builds them in the same order
_RAISED = "shardwise/pass-raised/{engine}/{rank}"
_STOPPED = "shardwise/pass-stopped/{engine}/{rank}"
POLL_SECONDS = 0.01


class PassDivergedError(DivergentExecutionError, AbandonedWait):
    """A forward or backward raised on some ranks of a tensor- or sequence-parallel group only."""


class PassFailures:
    def __init__(self, rank: int, peers: Iterable[int], timeout_seconds: float):
        """`peers`: the ranks whose forward pairs with this rank's (its tensor and
        sequence groups); `timeout_seconds`: how long a raising rank waits for them."""
        self.engine = next(_ENGINES)
        self.rank = rank
        self.peers = tuple(sorted(set(peers) - {rank}))
        self.timeout_seconds = timeout_seconds
        self.passes = 0  # forwards begun, alike on every rank
        self.raised_in: set[int] = set()
        self.store = dist.distributed_c10d._get_default_store()  # private, as in distributed/peers.py

    def begin_pass(self) -> None:
        self.passes += 1

    def raised(self, error: BaseException) -> PassDivergedError | None:
        """This rank's forward or backward raised `error`: note it, and wait until every
        peer raised in the same pass (None: the pass can be skipped) or stopped (the
        error to raise instead of `error`)."""
        current = self.passes
        self.raised_in.add(current)
        described = f"{type(error).__name__}: {error}"
        self.store.set(self._key(_RAISED, self.rank), json.dumps({"pass": current, "error": described}))
        waiting = set(self.peers)
        deadline = time.monotonic() + self.timeout_seconds
        while waiting:
            for peer in sorted(waiting):
                stopped = self._read(_STOPPED, peer)
                if stopped is not None:
                    return PassDivergedError(f"rank {self.rank}: {stopped}")
                note = self._read(_RAISED, peer)
                if note is not None and json.loads(note)["pass"] == current:
                    waiting.discard(peer)
            if waiting and time.monotonic() > deadline:
                return PassDivergedError(
                    f"rank {self.rank}: a forward or backward raised on some ranks only: this rank raised "
                    f"{described} in forward pass {current}, and rank(s) {', '.join(map(str, sorted(waiting)))} "
                    f"of its tensor/sequence-parallel group neither raised nor stopped within "
                    f"{self.timeout_seconds:g}s. {_ADVICE}")
            if waiting:
                time.sleep(POLL_SECONDS)
        return None

    def check_blocked(self, ranks: tuple[int, ...], what: str) -> None:
        """Blocked in `what` over `ranks`: raise if one of them stopped, or raised in a pass
        (this one or before) that this rank did not raise in, so will never come."""
        for peer in ranks:
            if peer == self.rank:
                continue
            stopped = self._read(_STOPPED, peer)
            if stopped is not None:
                raise PassDivergedError(f"rank {self.rank}: while waiting in {what}: {stopped}")
            note = self._read(_RAISED, peer)
            if note is None:
                continue
            raised = json.loads(note)
            if raised["pass"] in self.raised_in or raised["pass"] > self.passes:
                continue
            message = (f"a forward or backward raised on some ranks only: rank {peer} raised {raised['error']} "
                       f"in forward pass {raised['pass']}, which rank {self.rank} ran without an error and was "
                       f"waiting for rank {peer} in ({what}). {_ADVICE}")
            self.store.set(self._key(_STOPPED, self.rank), message)
            raise PassDivergedError(f"rank {self.rank}: {message}")

    def _key(self, template: str, rank: int) -> str:
        return template.format(engine=self.engine, rank=rank)

    def _read(self, template: str, rank: int) -> str | None:
        key = self._key(template, rank)
        return self.store.get(key).decode() if self.store.check([key]) else None


_ADVICE = ("Ranks of a tensor- or sequence-parallel group compute each forward together, so one cannot skip a "
           "batch the others run: skip a bad batch on every rank (e.g. agree on it first), or let the error end "
           "the run")
