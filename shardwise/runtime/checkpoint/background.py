"""Asynchronous saves: the rank's share copied to host memory, then written, verified and
published by a background thread while training goes on (`CheckpointPolicy.asynchronous`).

What the training thread pays is the copy (save.py `capture_checkpoint`); the thread
writes the same files as a synchronous save, through the same staging directory,
checksums and renames (manifest.py), so a process killed during the write leaves the
previous checkpoint as `latest`, loadable. The ranks agree on the write's success, and
rank 0 publishes, over a process group of their own (gloo, created at the first
asynchronous save while every rank is inside it): a collective of the writer threads
can then never pair with one of the training threads, as torch DCP's `async_save` asks
for its own group too.

One save at a time: the next save, a load, `engine.wait_for_checkpoint()` and
`engine.destroy()` join the write first. A failed write is agreed on by the threads, so
every rank raises it, as a `CheckpointError`, from whichever of those calls comes next;
one still pending when the interpreter exits is logged.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import threading
import weakref
from typing import Callable

import torch
import torch.distributed as dist

from shardwise.runtime.checkpoint.format import CheckpointError

log = logging.getLogger("shardwise")


class HostBuffers:
    """Host copies of a rank's checkpoint tensors, kept from one save to the next (the
    pieces a rank owns keep their names and sizes, so after the first save a capture
    allocates nothing). Pinned when the tensors live on a GPU, so the copies run at the
    link's speed and can all be queued before one synchronisation."""

    def __init__(self, device: torch.device):
        self.device = device
        self._buffers: dict[str, torch.Tensor] = {}
        self._pending_device_copies = False

    def copy(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        flat = tensor.detach().reshape(-1)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.dtype != flat.dtype or buffer.numel() != flat.numel():
            buffer = torch.empty(flat.numel(), dtype=flat.dtype, pin_memory=flat.is_cuda)
            self._buffers[key] = buffer
        buffer.copy_(flat, non_blocking=flat.is_cuda)
        self._pending_device_copies |= flat.is_cuda
        return buffer

    def settle(self) -> None:
        """Wait for the queued device-to-host copies: the writer reads the buffers next."""
        if self._pending_device_copies:
            torch.cuda.current_stream(self.device).synchronize()
            self._pending_device_copies = False

    def keep_only(self, keys: set[str]) -> None:
        """Drop buffers of pieces this save no longer has (after a reload at another layout)."""
        for key in [key for key in self._buffers if key not in keys]:
            del self._buffers[key]


class BackgroundWriter:
    """Runs one checkpoint write at a time on a thread; `wait` joins it and raises its error."""

    def __init__(self, *, world_size: int, timeout: datetime.timedelta, device: torch.device):
        self.world_size = world_size
        self.timeout = timeout
        self.buffers = HostBuffers(device)
        self._group: dist.ProcessGroup | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._tag: str | None = None
        atexit.register(_report_at_exit, weakref.ref(self))

    def group(self) -> dist.ProcessGroup | None:
        """The writers' own process group (None for one rank). Collective the first time:
        called on the training thread of every rank, inside the same save."""
        if self._group is None and self.world_size > 1:
            self._group = dist.new_group(backend="gloo", timeout=self.timeout)
        return self._group

    @property
    def busy(self) -> bool:
        return self._thread is not None

    def start(self, tag: str, write: Callable[[], None]) -> None:
        self.wait()
        self._tag = tag

        def run() -> None:
            try:
                write()
            except BaseException as error:  # kept for the training thread, which raises it
                self._error = error

        self._thread = threading.Thread(target=run, name=f"shardwise-checkpoint-{tag}", daemon=False)
        self._thread.start()

    def close(self) -> None:
        """Destroy the writers' process group (its engine is destroyed): it is this
        writer's alone, and each holds threads until destroyed. Call after `wait`."""
        group, self._group = self._group, None
        if group is not None:
            dist.destroy_process_group(group)

    def wait(self) -> None:
        """Join the write in progress, if any, and raise what it raised."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        error, self._error = self._error, None
        if error is None:
            return
        if isinstance(error, CheckpointError):
            raise CheckpointError(f"the asynchronous save of checkpoint {self._tag!r} failed: {error}") from error
        raise CheckpointError(f"the asynchronous save of checkpoint {self._tag!r} failed: "
                              f"{type(error).__name__}: {error}") from error


def _report_at_exit(reference: weakref.ref) -> None:
    """Non-daemon threads are joined before atexit handlers run, so the write is over:
    say if it failed, since no later call will raise it."""
    writer = reference()
    if writer is None or writer._error is None:
        return
    log.error("shardwise: the asynchronous save of checkpoint %r failed and the program exited before "
              "a later call could raise it: %s: %s", writer._tag, type(writer._error).__name__, writer._error)
