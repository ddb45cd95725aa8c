"""Stopping a training run early and cleanly: on SIGINT, SIGTERM or SIGHUP every rank
finishes its step, the ranks write a checkpoint together, and they exit.

torchrun's agent forwards a signal to the ranks one after another, so they receive it
at slightly different times, and a rank that stopped on its own would leave the others
waiting in a collective. The handler therefore only notes the signal; once per step the
ranks all-reduce what they noted (MAX, on the control path) and all stop after the first
step at which any of them had one. Later signals are ignored: the launcher answers a
second Ctrl-C by exiting at once, and the ranks die with it (`shardwise.tools.launcher.lifeline`).

A rank stopped this way exits with 128 + the signal's number, as a shell reports a
process ended by that signal; `stopped_by` recognises those exit codes in the launcher.
This module imports torch only when the ranks agree, so the worker can install the
handler before the seconds that importing torch takes.
"""

from __future__ import annotations

import signal
from collections.abc import Iterable
from types import FrameType
from typing import TYPE_CHECKING

from shardwise.tools.launcher.interrupts import STOP_SIGNALS

if TYPE_CHECKING:
    from shardwise.runtime.engine import Engine


class StopRequest:
    """`stop = StopRequest().install()`, then `if stop.agreed(engine): ...` once per step."""

    def __init__(self) -> None:
        self.signum = 0

    def install(self) -> StopRequest:
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._note)
        return self

    def _note(self, signum: int, frame: FrameType | None) -> None:
        if not self.signum:
            self.signum = signum

    def agreed(self, engine: Engine) -> int:
        """Collective, called by every rank at the same point of every step: the number of
        the signal some rank received (the highest, if several), or 0 when none did.
        Once non-zero it is also this rank's `signum`, so every rank holds the same one."""
        import torch
        import torch.distributed as dist

        noted = torch.tensor([self.signum], dtype=torch.int64)
        engine.comm.control_all_reduce(noted, "stop request", op=dist.ReduceOp.MAX)
        agreed = int(noted.item())
        if agreed:
            self.signum = agreed
        return agreed


def exit_code(signum: int) -> int:
    """The exit status of a rank that stopped early because of signal `signum`."""
    return 128 + signum


def stopped_by(exit_codes: Iterable[int]) -> int:
    """The signal the ranks stopped early for, when every failed rank's exit code says
    so (the ranks agree on the signal, so the codes are equal); else 0."""
    codes = set(exit_codes)
    for signum in STOP_SIGNALS:
        if codes == {exit_code(signum)}:
            return signum
    return 0
