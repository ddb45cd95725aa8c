"""All-gather, reduce-scatter and all-reduce through shared memory, for the ranks of a gloo group that
all run on one host (issue 27 item 2).

gloo moves a host's bytes between its ranks over TCP loopback: the sender's kernel copies
them into a socket, a receive thread per process wakes and copies them out, about 1.2-1.9
GB/s per rank here. On a 2-core machine that thread's kernel time is taken from the
ranks' compute: profiling ZeRO-3 at 25M put 0.12 s of its 0.2 s per step above the
no-communication floor there. Through a shared segment each byte is copied in by its
sender and out by its receiver, memcpy at about 10 GB/s, with no socket and no thread
of the kernel's.

The segment (one header line and one slot per member, protocol in shared_memory.c) is
created in /dev/shm by member 0 when the group's first eligible collective is issued,
under a name sent over the group's control group; every member maps it, and member 0
unlinks it once all have, so nothing is left behind however a process ends. The loops
are C (built on first use with the system's compiler, loaded with ctypes, which releases
the GIL): a worker thread per group runs the group's collectives in issue order while the
Python thread computes, so they stay asynchronous. A wait for a peer spins briefly, then
sleeps on a futex; every 0.1 s it checks the peer's process still exists, and at the
collective timeout it gives up; either way the collective fails naming the peer instead
of hanging. Reduce-scatter sums the members' chunks in member order in float32 (float64
for float64; bfloat16 rounded once at the end), which may differ from gloo's sum in the
last bit. A reduce-scatter that averages (`divide_by`: ZeRO's gradients) divides each
member's values as it copies them, the bits of dividing first, without a pass of its own.

Used by `Communicator` for CPU tensors of a gloo group whose members share this host
(same host name and boot id), when `SHARDWISE_SHARED_MEMORY` is not "0": reduce-scatter
and all-reduce of contiguous float32, float64 and bfloat16, all-gather of any contiguous
dtype; gloo otherwise. On by default: measured at 25M on 2 ranks (BENCHMARKS.md, "ZeRO-3 vs FSDP2
and DeepSpeed ZeRO-3") it takes ZeRO-3's step closer to the floor. Without a compiler the
group keeps gloo, warned once.
"""

from __future__ import annotations

import ctypes
import datetime
import os
import queue
import socket
import threading
import uuid
from pathlib import Path
from typing import Callable

import torch

from shardwise.runtime.base.native_build import CompiledLibrary, build_once

SOURCE = Path(__file__).with_name("shared_memory.c")
ENABLE_VARIABLE = "SHARDWISE_SHARED_MEMORY"
SLOT_VARIABLE = "SHARDWISE_SHARED_MEMORY_SLOT_BYTES"  # tests make it small to cross slots
DEFAULT_SLOT_BYTES = 4 << 20
MAX_MEMBERS = 64  # shared_memory.c's MAX_MEMBERS
HEADER_BYTES = 128  # shared_memory.c's HEADER_BYTES
FLAGS = ("-O3", "-march=native", "-shared", "-fPIC")
SUMMED_DTYPES = {torch.float32: 0, torch.float64: 1, torch.bfloat16: 2}
TIMED_OUT, PEER_GONE = 1, 2  # shared_memory.c's wait statuses

_P, _I, _L, _D = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_double
_SIGNATURES = {
    "sw_open": ([ctypes.c_char_p, _L, _I, ctypes.POINTER(_P)], _I),
    "sw_close": ([_P, _L], None),
    "sw_channel_bytes": ([], _L),
    "sw_channel_init": ([_P, _P, _I, _I, _L, _D], None),
    "sw_failed_peer": ([_P], _I),
    "sw_all_gather": ([_P, _P, ctypes.POINTER(_P), _L], _I),
    "sw_reduce_scatter": ([_P, _P, _P, _L, _I, _D], _I),
    "sw_all_reduce": ([_P, _P, _L, _I], _I),
    "sw_board_publish": ([_P, _I, ctypes.c_uint32], None),
    "sw_board_wait": ([_P, _I, ctypes.c_uint32], _I),
}


def enabled() -> bool:
    """Whether groups on one host may use shared memory (`SHARDWISE_SHARED_MEMORY=0`: never)."""
    return os.environ.get(ENABLE_VARIABLE, "1") != "0"


def library() -> ctypes.CDLL | None:
    """The compiled loops, built on first call (None, warned once, where they cannot be)."""
    return _compiled.get()


def _build() -> Path:
    return build_once(SOURCE, folder="distributed", flags=FLAGS)


def _load(path: Path) -> ctypes.CDLL:
    loaded = ctypes.CDLL(str(path))
    for name, (arguments, result) in _SIGNATURES.items():
        function = getattr(loaded, name)
        function.argtypes, function.restype = arguments, result
    return loaded


_compiled = CompiledLibrary(lambda: _load(_build()), what="the shared-memory collectives",
                            fallback="ranks on one host exchange their data over gloo's TCP loopback instead.")


def slot_bytes() -> int:
    text = os.environ.get(SLOT_VARIABLE)
    value = DEFAULT_SLOT_BYTES if text is None else int(text)
    if value < 64 * MAX_MEMBERS or value % 64:
        raise ValueError(f"{SLOT_VARIABLE}={text!r}: give a multiple of 64 bytes, at least {64 * MAX_MEMBERS}")
    return value


def host_identity() -> tuple[str, str]:
    """(host name, boot id): equal for processes that can share /dev/shm's files; a
    container with a /dev/shm of its own fails to open the segment, and the group keeps gloo."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return socket.gethostname(), boot


class SharedMemoryWork:
    """One collective queued on a channel's worker; `wait()` re-raises its failure."""

    def __init__(self, tensors: tuple[torch.Tensor, ...]):
        self._tensors = tensors  # alive until the worker is done with their memory
        self._finished = threading.Event()
        self._error: Exception | None = None

    def _run(self, call: Callable[[], None]) -> None:
        try:
            call()
        except Exception as error:  # re-raised by the waiting thread
            self._error = error
        finally:
            self._tensors = ()
            self._finished.set()

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if not self._finished.wait(None if timeout is None else timeout.total_seconds()):
            raise RuntimeError(f"not finished within {timeout.total_seconds():g}s")
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._finished.is_set()


class SharedMemoryChannel:
    """A mapped segment shared by the members of one group, and the worker thread that runs
    their collectives over it in issue order (every member issues them in the same order)."""

    def __init__(self, kernels: ctypes.CDLL, base: int, *, rank: int, global_ranks: tuple[int, ...], slot: int,
                 timeout: datetime.timedelta):
        """The segment stays mapped for the life of the process (the worker never ends)."""
        self._kernels = kernels
        self.rank, self.global_ranks = rank, global_ranks
        self.timeout = timeout
        self._state = ctypes.create_string_buffer(kernels.sw_channel_bytes())
        kernels.sw_channel_init(self._state, base, rank, len(global_ranks), slot, timeout.total_seconds())
        self._failure: RuntimeError | None = None  # after a failure the members' rounds no longer agree
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name=f"shardwise shared memory rank {global_ranks[rank]}",
                         daemon=True).start()

    def _serve(self) -> None:
        while True:
            work, call = self._queue.get()
            work._run(call)

    def _submit(self, tensors: tuple[torch.Tensor, ...], call: Callable[[], int]) -> SharedMemoryWork:
        def checked() -> None:
            if self._failure is not None:
                raise self._failure
            status = call()
            if status != 0:
                self._failure = self._describe(status)
                raise self._failure

        work = SharedMemoryWork(tensors)
        self._queue.put((work, checked))
        return work

    def _describe(self, status: int) -> RuntimeError:
        peer = self.global_ranks[self._kernels.sw_failed_peer(self._state)]
        if status == PEER_GONE:
            return RuntimeError(f"rank {peer}'s process exited (shared-memory transport)")
        if status == TIMED_OUT:
            return RuntimeError(f"rank {peer} did not reach the collective within {self.timeout.total_seconds():g}s "
                                "(shared-memory transport)")
        return RuntimeError(f"the shared-memory transport failed with status {status}")

    def all_gather(self, pieces: list[torch.Tensor], shard: torch.Tensor) -> SharedMemoryWork:
        """Each member's contiguous `shard` into `pieces[member]` (contiguous, shard's size)."""
        outputs = (ctypes.c_void_p * len(pieces))(*(piece.data_ptr() for piece in pieces))
        nbytes = shard.numel() * shard.element_size()
        return self._submit((shard, *pieces), lambda: self._kernels.sw_all_gather(
            self._state, shard.data_ptr(), outputs, nbytes))

    def reduce_scatter(self, output: torch.Tensor, full: torch.Tensor, *, divide_by: float = 1.0) -> SharedMemoryWork:
        """The sum over members of their chunk `rank` of contiguous `full`, each member's
        values divided by `divide_by` first (the bits `full.div_(divide_by)` before the sum
        gives, without that pass over `full` on the caller's thread; `full` is left as it
        is), into `output`."""
        dtype = SUMMED_DTYPES[full.dtype]
        return self._submit((output, full), lambda: self._kernels.sw_reduce_scatter(
            self._state, full.data_ptr(), output.data_ptr(), output.numel(), dtype, float(divide_by)))

    def all_reduce(self, tensor: torch.Tensor) -> SharedMemoryWork:
        """Contiguous `tensor` becomes the sum over members, the same bits on every member."""
        dtype = SUMMED_DTYPES[tensor.dtype]
        return self._submit((tensor,), lambda: self._kernels.sw_all_reduce(
            self._state, tensor.data_ptr(), tensor.numel(), dtype))


_channels: dict[tuple[str, tuple[int, ...]], SharedMemoryChannel | None] = {}


def shared_channel(purpose: str, *, rank: int, global_ranks: tuple[int, ...], timeout: datetime.timedelta,
                   gather: Callable[[object], list[object]]) -> SharedMemoryChannel | None:
    """The channel of the group for `purpose` over `global_ranks`, connected once per process:
    engines built one after another (a sweep, a notebook) reuse their groups' segment and
    worker thread, as they reuse the process groups (group_cache.py), instead of piling up a
    thread and a segment per engine. Every member keys it alike, so their rounds stay in step."""
    key = (purpose, global_ranks)
    if key not in _channels:
        _channels[key] = connect(rank=rank, global_ranks=global_ranks, timeout=timeout, gather=gather)
    return _channels[key]


def connect(*, rank: int, global_ranks: tuple[int, ...], timeout: datetime.timedelta,
            gather: Callable[[object], list[object]]) -> SharedMemoryChannel | None:
    """Map a segment shared by every member of a group, or None (on every member alike)
    when they are not on one host, the loops cannot be built, or a member cannot map it.
    `gather(value)` returns every member's value (the group's control all-gather)."""
    size = len(global_ranks)
    kernels = library()
    name = f"shardwise-{os.getpid()}-{uuid.uuid4().hex[:12]}" if rank == 0 else None
    members = gather((host_identity(), kernels is not None, name))
    if size > MAX_MEMBERS or any(m[0] != members[0][0] or not m[1] for m in members):
        return None
    slot = slot_bytes()
    total = segment_bytes(size, slot)
    path = f"/dev/shm/{members[0][2]}"
    base, status = map_segment(kernels, path, total, create=True) if rank == 0 else (None, 0)
    if gather(status)[0] != 0:
        return None
    if rank != 0:
        base, status = map_segment(kernels, path, total, create=False)
    statuses = gather(status)
    if rank == 0:
        os.unlink(path)
    if any(statuses):
        if status == 0:
            kernels.sw_close(base, total)
        return None
    return SharedMemoryChannel(kernels, base, rank=rank, global_ranks=global_ranks, slot=slot, timeout=timeout)


def segment_bytes(members: int, slot: int) -> int:
    return members * (HEADER_BYTES + slot)


def map_segment(kernels: ctypes.CDLL, path: str, nbytes: int, *, create: bool) -> tuple[int | None, int]:
    """(address, 0) of the file at `path` mapped shared, created (and its pages reserved:
    a full /dev/shm fails here rather than at first touch) when `create`; (None, errno)
    when it cannot be."""
    base = ctypes.c_void_p()
    status = kernels.sw_open(path.encode(), nbytes, int(create), ctypes.byref(base))
    return (base.value, 0) if status == 0 else (None, status)
