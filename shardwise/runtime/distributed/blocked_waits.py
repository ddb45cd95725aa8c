"""A check that runs while a rank is blocked in a gloo collective, so a peer that will
never come can be named at once instead of at the collective timeout.

A collective blocks until every member has entered it. When a member never will (its
forward raised part-way, and the collectives the others wait in belong to the rest of
that forward), the wait ends only at the process group's timeout, with gloo's "Timed
out waiting" and no word on why. Whoever knows why (reliability/pass_failures.py, which
reads the peers' notes in the c10d store) registers a check here; while a check is
registered, a gloo wait is cut into slices of `SLICE`, and between slices the check
may raise `AbandonedWait`. A wait that finishes within its first slice costs nothing
more, and the process group's own timeout still ends a wait the check never stops.

NCCL's waits do not block the host (the stream waits), so they are left as they are.
"""

from __future__ import annotations

import datetime
from typing import Callable, Protocol

SLICE = datetime.timedelta(seconds=0.2)

# (ranks of the collective's group, what is waited for) -> None, or raises AbandonedWait
Check = Callable[[tuple[int, ...], str], None]


class AbandonedWait(RuntimeError):
    """Raised by a check: a member of the group will never enter the collective."""


class _Work(Protocol):
    def wait(self, timeout: datetime.timedelta = ...) -> bool: ...

    def is_completed(self) -> bool: ...


_check: Check | None = None


def watch_blocked_waits(check: Check | None) -> None:
    """Register `check` (None: none) for the gloo waits of this process from now on."""
    global _check
    _check = check


def watched_check() -> Check | None:
    return _check


def wait_watching(work: _Work, check: Check, ranks: tuple[int, ...], what: str) -> bool:
    """`work.wait()`, with `check(ranks, what)` between slices while it is not finished.
    gloo's `wait(timeout)` raises when the slice runs out and leaves the work running; a
    work that has completed (with an error: a lost peer, the group's timeout) re-raises."""
    while True:
        try:
            return work.wait(SLICE)
        except Exception:
            if work.is_completed():
                raise
        check(ranks, what)
