"""A launcher stopped by SIGINT, SIGTERM or SIGHUP: workers stopped, one line, no traceback.

torchrun's agent, left to itself, raises its `SignalException` from a signal handler,
forwards the signal to every worker, logs each step of that at WARNING, and lets the
exception end the launcher with a traceback. Here the launcher's command runs inside
`interruptible()`: a stop signal raises `Interrupted`, which the command turns into its
one line on stderr and exit status 128 + signal number. While the agent runs
(`agent_signals()`) the handler raises the agent's `SignalException` instead, so the
agent still forwards the signal and waits for the workers (killing those that outlast
its shutdown timeout), and what leaves the block is `Interrupted` again. A second signal
cuts that wait short: the launcher kills its workers (`lifeline.kill_workers`) and ends
as after the first. From the first stop signal on, log output is switched off: the
agent's shutdown messages would bury the one line.

Before the command reaches `interruptible()` (parsing, importing torch: seconds), a stop
signal would kill the launcher with a KeyboardInterrupt traceback, or, in a job started
in the background, where the shell sets SIGINT to be ignored, be lost, and the job would
run to its end. `defer_stop_signals()`, called first thing by the commands that launch
workers, notes such a signal, and `raise_deferred_stop()`, first thing inside the command's
`interruptible()` block, raises it as `Interrupted`, before any worker starts.

The agent is told to handle only SIGQUIT itself (`AGENT_SIGNALS`), so that it does not
replace these handlers when it starts the workers.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

from shardwise.tools.launcher.lifeline import kill_workers

STOP_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name)
)
AGENT_SIGNALS = "SIGQUIT"


class Interrupted(Exception):
    """The launcher received a stop signal."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"interrupted by {self.signal_name}")

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        """What a shell reports for a process ended by this signal."""
        return 128 + self.signum


class _StopHandler:
    """The handler `interruptible` installs; `raises` builds the exception it raises."""

    def __init__(self) -> None:
        self.received = 0  # stop signals so far
        self.raises: Callable[[int], BaseException] = Interrupted

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.received += 1
        if self.received == 1:
            logging.disable(logging.CRITICAL)
        raise self.raises(signum)


_active: _StopHandler | None = None
_deferred: list[int] = []  # stop signals received before `interruptible()`
_before_deferral: dict[int, object] = {}  # the handlers `interruptible()` restores on exit


def defer_stop_signals() -> None:
    """From now until `interruptible()`: remember stop signals (main thread only)."""
    if threading.current_thread() is threading.main_thread():
        for signum in STOP_SIGNALS:
            _before_deferral.setdefault(signum, signal.getsignal(signum))
            signal.signal(signum, lambda received, frame: _deferred.append(received))


@contextmanager
def interruptible() -> Iterator[None]:
    """Within the block a stop signal raises `Interrupted`; outside the main thread, where
    Python delivers no signals, and when already inside such a block, it changes nothing."""
    global _active
    if _active is not None or threading.current_thread() is not threading.main_thread():
        yield
        return
    handler = _StopHandler()
    previous = {signum: _before_deferral.pop(signum, signal.getsignal(signum)) for signum in STOP_SIGNALS}
    for signum in STOP_SIGNALS:
        signal.signal(signum, handler)
    _active = handler
    try:
        yield
    finally:
        _active = None
        for signum, action in previous.items():
            signal.signal(signum, action)
        if handler.received:
            logging.disable(logging.NOTSET)


def raise_deferred_stop() -> None:
    """Inside `interruptible()`: raise a stop signal `defer_stop_signals` noted as if it
    came now (a no-op when none did)."""
    if _deferred and _active is not None:
        signum = _deferred[0]
        _deferred.clear()
        _active(signum, None)


@contextmanager
def agent_signals() -> Iterator[None]:
    """Within an `interruptible` block, around torchrun's agent: stop signals raise the
    agent's `SignalException` (which it answers by stopping the workers), and that
    exception leaves the block as `Interrupted`."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    with interruptible():
        handler = _active
        if handler is not None:
            handler.raises = _agent_exception(handler)
        try:
            yield
        except SignalException as error:
            raise Interrupted(error.sigval) from None
        finally:
            if handler is not None:
                handler.raises = Interrupted


def _agent_exception(handler: _StopHandler) -> Callable[[int], BaseException]:
    from torch.distributed.elastic.multiprocessing.api import SignalException

    def build(signum: int) -> BaseException:
        # The agent answers any exception, a second SignalException included, by shutting
        # the workers down again and waiting for them: after a second signal there is
        # nothing left to wait for.
        if handler.received > 1:
            kill_workers()
        sigval = signal.Signals(signum)
        return SignalException(f"shardwise launcher got {sigval.name}", sigval=sigval)

    return build
