"""`run_distributed`: run a function on N local ranks and fail loudly when any rank does.

A multi-rank test fails in one of three ways: a rank raises (its peers then block in the
next collective), a rank dies without raising (segfault, `os._exit`, OOM kill), or nothing
finishes. The parent watches every rank's report pipe and process sentinel at once, so it
notices each of these within milliseconds, stops every rank, and raises one error that
names the rank and carries its traceback.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.context import ForkServerContext
from multiprocessing.process import BaseProcess
from typing import Any

from shardwise.tools.testing.forkserver import preloaded_forkserver_context
from shardwise.tools.testing.worker import (
    COLLECTIVE_TIMEOUT_VARIABLE,
    InheritedFd,
    ProcessGroupStartError,
    RankJob,
    RankRaised,
    RankReturned,
    pickle_call,
    run_rank,
)

MASTER_ADDR = "127.0.0.1"
# Variables the harness owns; a caller's `env` may not override them.
RENDEZVOUS_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)
# A rank that finished cleanly is already exiting; this only bounds a wedged interpreter exit.
EXIT_GRACE_S = 5.0


class DistributedTestError(Exception):
    """A rank raised, died or hung. `ranks` are the ranks the message is about;
    `before_start`: every failure was a process group that did not form (no rank died, and
    none ran the function).

    Ranks that died come first: a peer's error in the same report ("connection closed") is
    usually a consequence of the death.
    """

    def __init__(self, message: str, ranks: list[int], before_start: bool = False) -> None:
        super().__init__(message)
        self.ranks = ranks
        self.before_start = before_start


@dataclass
class _RankProcess:
    rank: int
    process: BaseProcess
    reports: Connection


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    backend: str = "gloo",
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Call `fn(rank, world_size, *args, **kwargs)` on `world_size` fresh processes.

    Each rank gets the torchrun environment variables, one intra-op thread and an
    initialised default process group whose collectives time out after
    `SHARDWISE_COLLECTIVE_TIMEOUT` seconds (default: min(30, timeout / 2), so a rank stuck
    in a collective raises a readable error before the whole run times out). `fn` must be
    a module-level function; arguments and return values must be picklable. Returns the
    return values ordered by rank; raises `DistributedTestError` if any rank raises, dies
    or is still running after `timeout` seconds.
    """
    _check_arguments(fn, world_size, timeout, env)
    call = _pickled_call(fn, args, kwargs)
    try:
        return _launch(call, world_size, timeout, backend, env or {})
    except DistributedTestError as error:
        # Gloo over loopback on a loaded machine once closed a pair while the group formed
        # ("connectFullMesh failed ... Connection closed by peer"), before any rank ran the
        # function: such a start, and only such a one, is tried once more with new ranks.
        if not error.before_start:
            raise
        return _launch(call, world_size, timeout, backend, env or {})


def _launch(call: bytes, world_size: int, timeout: float, backend: str, env: dict[str, str]) -> list[Any]:
    """Start the ranks on a fresh rendezvous and collect their results."""
    context = preloaded_forkserver_context()
    environment = _shared_environment(world_size, timeout, env)
    ranks: list[_RankProcess] = []
    finished_cleanly = False
    # The ranks meet through a file store in a fresh directory rather than a TCP store: no
    # port to race for, and no per-connection reverse-DNS lookup (c10d's TCP store does one,
    # which stalls 5 s whenever a resolver drops the query).
    with tempfile.TemporaryDirectory(prefix="shardwise-ranks-") as rendezvous_dir:
        try:
            for rank in range(world_size):
                job = RankJob(
                    rank=rank,
                    world_size=world_size,
                    call=call,
                    backend=backend,
                    store_path=os.path.join(rendezvous_dir, "store"),
                    environment={**environment, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                    stdout=InheritedFd(_fd_of(sys.stdout, default=1)),
                    stderr=InheritedFd(_fd_of(sys.stderr, default=2)),
                    linger_s=timeout,
                )
                ranks.append(_start_rank(context, job))
            results = _collect_results(ranks, deadline=time.monotonic() + timeout, timeout=timeout)
            finished_cleanly = True
            return results
        finally:
            _stop(ranks, graceful=finished_cleanly)


def _check_arguments(fn: Callable[..., Any], world_size: int, timeout: float, env: dict[str, str] | None) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if timeout <= 0:
        raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
    reserved = sorted(set(env or {}) & set(RENDEZVOUS_VARIABLES))
    if reserved:
        raise ValueError(f"env may not set {', '.join(reserved)}: run_distributed sets them for each rank")
    try:
        pickle.dumps(fn)
    except Exception as error:
        raise TypeError(
            f"run_distributed needs a module-level function (each rank imports it by name); "
            f"{fn!r} cannot be pickled: {error}"
        ) from error


def _pickled_call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
    try:
        return pickle_call(fn, args, kwargs)
    except Exception as error:
        raise TypeError(f"run_distributed arguments must be picklable: {error}") from error


def _shared_environment(world_size: int, timeout: float, env: dict[str, str]) -> dict[str, str]:
    """The parent's environment as it is now (the fork server's is from when it started)."""
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        COLLECTIVE_TIMEOUT_VARIABLE: f"{min(30.0, timeout / 2):g}",
        **env,
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": MASTER_ADDR,
        "MASTER_PORT": str(_free_port()),
    }


def _free_port() -> int:
    """A port for code under test that starts an env:// rendezvous of its own (rank 0 listens).

    The harness does not use it; the gap between picking and binding it is that code's risk.
    """
    with socket.socket() as probe:
        probe.bind((MASTER_ADDR, 0))
        return probe.getsockname()[1]


def _start_rank(context: ForkServerContext, job: RankJob) -> _RankProcess:
    reports, child_end = context.Pipe(duplex=False)
    process = context.Process(target=run_rank, args=(job, child_end), name=f"rank-{job.rank}", daemon=True)
    try:
        process.start()
    finally:
        # Only the child may hold the write end, so that its death reads as end-of-file here.
        child_end.close()
    return _RankProcess(job.rank, process, reports)


def _fd_of(stream: Any, default: int) -> int:
    """The stream's descriptor, or `default` for a stand-in without one (pytest `--capture=sys`)."""
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):
        return default


def _collect_results(ranks: list[_RankProcess], deadline: float, timeout: float) -> list[Any]:
    results: dict[int, Any] = {}
    while len(results) < len(ranks):
        running = [rank for rank in ranks if rank.rank not in results]
        remaining = deadline - time.monotonic()
        handles = [rank.reports for rank in running] + [rank.process.sentinel for rank in running]
        ready = wait(handles, timeout=max(remaining, 0.0))
        if not ready:
            waiting_for = [rank.rank for rank in running]
            raise DistributedTestError(
                f"timed out after {timeout:g} s; still running: {_rank_list(waiting_for)} "
                f"(finished: {_rank_list(sorted(results)) or 'none'})",
                waiting_for,
            )
        deaths: list[tuple[int, str]] = []
        raises: list[tuple[int, str]] = []
        kinds: list[str] = []  # the raised exceptions' types
        # Look at every rank, not only those `wait` returned: a peer's "connection closed"
        # error can be read before the death that caused it, and both belong in the report.
        for rank in running:
            if not rank.reports.poll() and rank.process.is_alive():
                continue
            report = _read_report(rank)
            if isinstance(report, RankReturned):
                results[rank.rank] = report.value
            elif isinstance(report, RankRaised):
                raises.append((rank.rank, _describe_raise(rank.rank, report)))
                kinds.append(report.exception_type)
            else:
                deaths.append((rank.rank, _describe_death(rank)))
        if deaths or raises:
            failures = deaths + raises
            message = "\n\n".join(text for _, text in failures)
            before_start = not deaths and all(kind == ProcessGroupStartError.__name__ for kind in kinds)
            raise DistributedTestError(f"{message}\n\n(the other ranks were stopped)", [r for r, _ in failures],
                                       before_start)
    return [results[rank] for rank in range(len(ranks))]


def _read_report(rank: _RankProcess) -> RankReturned | RankRaised | None:
    """The rank's report, or None if it exited without sending one."""
    if not rank.reports.poll():
        return None
    try:
        return rank.reports.recv()
    except EOFError:
        return None


def _describe_raise(rank: int, report: RankRaised) -> str:
    return (
        f"rank {rank} raised {report.exception_type}: {report.message}\n"
        f"--- rank {rank} traceback ---\n{report.traceback.rstrip()}"
    )


def _describe_death(rank: _RankProcess) -> str:
    # End-of-file on the pipe can arrive a moment before the fork server reports the exit code.
    rank.process.join(EXIT_GRACE_S)
    code = rank.process.exitcode
    if code is not None and code < 0:
        name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
        return f"rank {rank.rank} was killed by {name} (exit code {code}) before returning"
    return f"rank {rank.rank} exited with code {code} before returning"


def _rank_list(ranks: list[int]) -> str:
    return ", ".join(f"rank {rank}" for rank in ranks)


def _stop(ranks: list[_RankProcess], graceful: bool) -> None:
    """Leave no process behind: kill (or, after success, reap) every rank and free its handles."""
    for rank in ranks:
        if graceful:
            rank.process.join(EXIT_GRACE_S)
        if rank.process.is_alive():
            rank.process.kill()
    for rank in ranks:
        rank.process.join()
        rank.process.close()
        rank.reports.close()
