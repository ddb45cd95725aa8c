"""A segment of /dev/shm whose data every member of a group on one host reads in place,
with a board of counters to say when it may (issue 27 item 2: stage 3's node-shared
parameters, zero/shared_param_home.py).

Where the shared-memory transport (shared_memory.py) copies each member's bytes in and
every member's bytes out, a region is memory the members share outright: each writes its
own part, and reads the others' parts where they lie. What it needs instead of a copy is
agreement on when: the board (one header line per member, as the transport's segment
has, protocol in shared_memory.c) holds two counters per member that only it writes,

    barrier   bumped as the member arrives at a meeting point (`meet`): a writer meets the
              others before it writes, so no peer still reads the old values;
    version   the last meeting after which the member finished writing its part
              (`publish`): a reader waits until every peer's version has reached its own
              (`wait_current`), so it reads what every peer wrote since their last meeting.

Versions are numbered by meetings rather than counted, so a member that writes without
meeting first (a local edit on one rank) cannot run ahead of the others for good: its
`publish` changes nothing, and the writes are simply there for the next reader.

A wait spins briefly, then sleeps on a futex; every 0.1 s it checks that the peer's
process still exists, and at the collective timeout it gives up: either way it raises
naming the peer, never hangs. The segment is created by member 0 under a name sent over
the group's control group, mapped by every member (Python's mmap: the mapping lives as
long as a tensor over it does) and unlinked by member 0 once all have mapped it, so
nothing is left behind however a process ends. Its size is reserved when it is created:
a /dev/shm too small fails there, and the caller keeps its own memory instead.
"""

from __future__ import annotations

import ctypes
import datetime
import mmap
import os
import uuid
from typing import Callable

import torch

from shardwise.runtime.distributed import shared_memory

_VERSION, _BARRIER = 0, 1
_PAGE = 4096


class SharedRegion:
    """A mapped region and this member's side of its board; `tensor` views its data."""

    def __init__(self, mapping: mmap.mmap, kernels: ctypes.CDLL, *, rank: int, global_ranks: tuple[int, ...],
                 timeout: datetime.timedelta):
        self._kernels = kernels
        self.global_ranks = global_ranks
        self.timeout = timeout
        whole = torch.frombuffer(mapping, dtype=torch.uint8)
        self._mapping = mapping
        self._state = ctypes.create_string_buffer(kernels.sw_channel_bytes())
        kernels.sw_channel_init(self._state, whole.data_ptr(), rank, len(global_ranks), 0, timeout.total_seconds())
        self._board = whole  # keeps the mapping alive while the board is used
        self.data_offset = board_bytes(len(global_ranks))
        self.version = 0
        self._peers_at = 0  # the version every peer is known to have reached
        self._barriers = 0

    def tensor(self, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """`numel` elements of `dtype` at byte `offset` of the data, a storage of their own
        (over the shared memory: no copy)."""
        return torch.frombuffer(self._mapping, dtype=dtype, count=numel, offset=self.data_offset + offset)

    def publish(self) -> None:
        """This member has finished writing its part since the last meeting."""
        if self.version == self._barriers:
            return
        self.version = self._barriers
        self._kernels.sw_board_publish(self._state, _VERSION, self.version)

    def wait_current(self) -> None:
        """Return once every peer has published at least this member's version."""
        if self._peers_at == self.version:
            return
        self._check(self._kernels.sw_board_wait(self._state, _VERSION, self.version))
        self._peers_at = self.version

    def meet(self) -> None:
        """Return once every member has arrived here (as many meetings as this one)."""
        self._barriers += 1
        self._kernels.sw_board_publish(self._state, _BARRIER, self._barriers)
        self._check(self._kernels.sw_board_wait(self._state, _BARRIER, self._barriers))

    def _check(self, status: int) -> None:
        if status == 0:
            return
        peer = self.global_ranks[self._kernels.sw_failed_peer(self._state)]
        if status == shared_memory.PEER_GONE:
            raise RuntimeError(f"rank {peer}'s process exited (shared parameter memory)")
        raise RuntimeError(f"rank {peer} did not arrive within {self.timeout.total_seconds():g}s "
                           "(shared parameter memory)")


def board_bytes(members: int) -> int:
    """The board's bytes, rounded up to a page so the data starts page-aligned."""
    return -(-members * shared_memory.HEADER_BYTES // _PAGE) * _PAGE


def connect_region(nbytes: int, *, rank: int, global_ranks: tuple[int, ...], timeout: datetime.timedelta,
                   gather: Callable[[object], list[object]]) -> SharedRegion | None:
    """A region of `nbytes` shared by every member of a group, or None (on every member
    alike) when they are not on one host, the C loops cannot be built, or /dev/shm cannot
    hold it. `gather(value)` returns every member's value (the group's control all-gather)."""
    kernels = shared_memory.library()
    name = f"shardwise-params-{os.getpid()}-{uuid.uuid4().hex[:12]}" if rank == 0 else None
    members = gather((shared_memory.host_identity(), kernels is not None, name))
    if len(global_ranks) > shared_memory.MAX_MEMBERS or any(m[0] != members[0][0] or not m[1] for m in members):
        return None
    path = f"/dev/shm/{members[0][2]}"
    total = board_bytes(len(global_ranks)) + nbytes
    mapping, status = _map(path, total, create=True) if rank == 0 else (None, 0)
    if gather(status)[0] != 0:
        return None
    if rank != 0:
        mapping, status = _map(path, total, create=False)
    statuses = gather(status)
    if rank == 0:
        os.unlink(path)
    if any(statuses):
        return None
    return SharedRegion(mapping, kernels, rank=rank, global_ranks=global_ranks, timeout=timeout)


def _map(path: str, nbytes: int, *, create: bool) -> tuple[mmap.mmap | None, int]:
    """(mapping, 0) of the file at `path`, created with its pages reserved when `create`;
    (None, errno) when it cannot be."""
    try:
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
    except OSError as error:
        return None, error.errno or -1
    try:
        if create:
            os.posix_fallocate(fd, 0, nbytes)
        return mmap.mmap(fd, nbytes), 0
    except OSError as error:
        if create:
            os.unlink(path)
        return None, error.errno or -1
    finally:
        os.close(fd)
