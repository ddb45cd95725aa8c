"""What runs inside one rank started by `run_distributed`.

The rank reports back over a pipe with exactly one message: `RankReturned` or
`RankRaised`. Anything else (no message at all) means the process died, which the parent
learns from the process sentinel.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing import reduction
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT_VARIABLE = "SHARDWISE_COLLECTIVE_TIMEOUT"


@dataclass(frozen=True)
class RankReturned:
    value: Any


@dataclass(frozen=True)
class RankRaised:
    exception_type: str
    message: str
    traceback: str


class InheritedFd:
    """A file descriptor of the launching process, duplicated into the rank at start-up.

    Fork-server children otherwise keep the stdout/stderr the fork server had when it
    started, which under pytest is the capture file of whichever test happened to start it.
    Pickling this object (which multiprocessing does while starting the process) hands the
    descriptor over; in the child it unpickles as the plain `int` of the duplicate.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Callable[..., int], tuple[Any]]:
        return _detach, (reduction.DupFd(self.fd),)


def _detach(duplicate: Any) -> int:
    return duplicate.detach()


@dataclass
class RankJob:
    """Everything one rank needs; pickled by multiprocessing into the child."""

    rank: int
    world_size: int
    call: bytes  # `pickle_call(fn, args, kwargs)`
    backend: str
    store_path: str  # file store the ranks meet through
    environment: dict[str, str]
    stdout: InheritedFd | int
    stderr: InheritedFd | int
    linger_s: float  # longest a failed rank waits to be stopped


def pickle_call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
    """The rank's function and arguments, pickled by value.

    multiprocessing's own pickler would move tensors to shared memory instead, so every
    rank, and the caller, would write into one storage.
    """
    return pickle.dumps((fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)


def run_rank(job: RankJob, reports: Connection) -> None:
    """Process target: set up the environment and process group, call `job.fn`, report."""
    for inherited, target in ((job.stdout, 1), (job.stderr, 2)):
        os.dup2(inherited, target)
        os.close(inherited)
    _exit_when_parent_exits()
    os.environ.clear()
    os.environ.update(job.environment)
    torch.set_num_threads(1)
    try:
        value = _call_in_process_group(job)
        _send_value(reports, value)
    except BaseException as error:  # noqa: BLE001 - every failure, SystemExit included, is reported
        reports.send(RankRaised(type(error).__qualname__, str(error), traceback.format_exc()))
        _linger_until_stopped(job.linger_s)
        raise SystemExit(1) from None


class ProcessGroupStartError(RuntimeError):
    """The rank's process group did not form, before the function under test ran (the
    harness may relaunch the ranks once: harness.py `run_distributed`)."""


def _call_in_process_group(job: RankJob) -> Any:
    timeout = timedelta(seconds=float(os.environ[COLLECTIVE_TIMEOUT_VARIABLE]))
    if job.backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    try:
        dist.init_process_group(
            job.backend,
            init_method=f"file://{job.store_path}",
            rank=job.rank,
            world_size=job.world_size,
            timeout=timeout,
        )
    except RuntimeError as error:
        raise ProcessGroupStartError(f"the {job.backend} process group did not form: {error}") from error
    fn, args, kwargs = pickle.loads(job.call)
    value = fn(job.rank, job.world_size, *args, **kwargs)
    dist.destroy_process_group()
    return value


def _send_value(reports: Connection, value: Any) -> None:
    """Send by value: a tensor sent by multiprocessing's pickler would refer to shared memory
    that this rank serves only while it lives, and it exits right after sending."""
    try:
        payload = pickle.dumps(RankReturned(value), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as error:
        raise TypeError(
            f"the return value ({type(value).__name__}) cannot be pickled back to the parent: {error}"
        ) from error
    reports.send_bytes(payload)


def _linger_until_stopped(limit_s: float) -> None:
    """Stay alive after reporting a failure until the parent stops this rank.

    Exiting at once would close this rank's sockets, and the peers blocked in a collective
    would then report "connection closed" errors of their own, racing the real cause.
    """
    parent = multiprocessing.parent_process()
    if parent is not None:
        wait([parent.sentinel], timeout=limit_s)


def _exit_when_parent_exits() -> None:
    """A rank whose parent died (even by SIGKILL) exits instead of lingering as an orphan."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()
