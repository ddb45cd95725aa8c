"""A rank's private swap file on NVMe, and the memory regions paged through it (C12).

Asynchronous I/O without a compiled extension: a small thread pool runs `os.preadv` /
`os.pwritev`, which release the GIL, in `aio.block_size` calls with `aio.queue_depth` of
them in flight (one at a time left the disk idle between calls: 59% of `dd`'s direct-read
bandwidth here, against 117% with 8; BENCHMARKS.md), on page-aligned buffers, with
`O_DIRECT` where the file system supports it (bypassing the page cache, so the bytes
really leave memory and reads measure the disk). io_uring would need a binding that is not in the standard
library; libaio a compiled extension; threads reach the disk's sequential bandwidth with
large blocks, which is what paging optimizer sub-groups needs.

Each region is an anonymous `mmap` (page-aligned, as `O_DIRECT` requires) seen by torch
as a flat tensor that never changes identity, so an optimizer's state dict keeps pointing
at it. Paging out writes the region and then returns its pages to the operating system
(`madvise(MADV_DONTNEED)`): resident memory falls, the tensor object stays. Paging in
reads the bytes back into the same pages.

The file is unlinked as soon as it is opened: it lives exactly as long as the process
(a killed rank leaves nothing behind), and `posix_fallocate` reserves its full size up
front, so a full disk is reported before training starts, with the path and the bytes.
"""

from __future__ import annotations

import errno
import mmap
import os
import shutil
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

ALIGN = 4096


def round_up(value: int, multiple: int = ALIGN) -> int:
    return -(-value // multiple) * multiple


class SwapError(RuntimeError):
    """The swap file cannot be created or written (path, permissions, space)."""


class Region:
    """`numel` elements of `dtype` in an anonymous mapping, backed by [offset, offset + nbytes)
    of the swap file."""

    def __init__(self, numel: int, dtype: torch.dtype, offset: int):
        self.numel = numel
        self.nbytes = round_up(max(1, numel * torch.empty((), dtype=dtype).element_size()))
        self.offset = offset
        self.memory = mmap.mmap(-1, self.nbytes)
        self.tensor = torch.frombuffer(self.memory, dtype=dtype, count=numel)

    def release(self) -> None:
        """Give the pages back; the contents are gone until the next read."""
        self.memory.madvise(mmap.MADV_DONTNEED)


class SwapFile:
    def __init__(self, directory: str | os.PathLike, rank: int, threads: int = 1, block_size: int = 1 << 20,
                 queue_depth: int = 1):
        """`threads` run region reads and writes (aio.thread_count); each splits its region
        into `block_size` calls, `queue_depth` of them in flight at once (aio.queue_depth):
        one call at a time leaves the disk idle between calls."""
        self.directory = Path(directory)
        self.block_size = round_up(block_size)
        self.path = self.directory / f".shardwise-swap-rank{rank}-{uuid.uuid4().hex[:8]}"
        self.fd, self.direct = _open_private(self.path)
        self.size = 0
        self.regions: list[Region] = []
        self.bytes_read = 0  # counted when a read or write is issued, for comm_volume()
        self.bytes_written = 0
        self.pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="shardwise-swap")
        self.blocks = ThreadPoolExecutor(max_workers=max(1, queue_depth), thread_name_prefix="shardwise-swap-io")

    def region(self, numel: int, dtype: torch.dtype) -> Region:
        """A new region at the end of the file (its space is reserved by `reserve`)."""
        region = Region(numel, dtype, self.size)
        self.size += region.nbytes
        self.regions.append(region)
        return region

    def reserve(self) -> None:
        """Allocate the whole file now: a full disk fails here, not mid-training."""
        try:
            os.posix_fallocate(self.fd, 0, max(self.size, ALIGN))
        except OSError as error:
            raise self._error(error, self.size) from None

    def write_all(self, regions: list[Region]) -> Future:
        """Write the regions out, then give their pages back, in the background."""
        self.bytes_written += sum(region.nbytes for region in regions)
        return self.pool.submit(lambda: [self._write(region, True) for region in regions])

    def read_all(self, regions: list[Region]) -> Future:
        self.bytes_read += sum(region.nbytes for region in regions)
        return self.pool.submit(lambda: [self._read(region) for region in regions])

    def _write(self, region: Region, release: bool) -> None:
        view = memoryview(region.memory)

        def block(start: int) -> None:
            stop, done = min(start + self.block_size, region.nbytes), start
            while done < stop:
                try:
                    done += os.pwritev(self.fd, [view[done:stop]], region.offset + done)
                except OSError as error:
                    raise self._error(error, region.nbytes) from None

        list(self.blocks.map(block, range(0, region.nbytes, self.block_size)))
        if release:
            region.release()

    def _read(self, region: Region) -> None:
        view = memoryview(region.memory)

        def block(start: int) -> None:
            stop, done = min(start + self.block_size, region.nbytes), start
            while done < stop:
                count = os.preadv(self.fd, [view[done:stop]], region.offset + done)
                if count == 0:
                    raise SwapError(f"swap file {self.path} ended at byte {region.offset + done}")
                done += count

        list(self.blocks.map(block, range(0, region.nbytes, self.block_size)))

    def _error(self, error: OSError, needed: int) -> SwapError:
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            free = shutil.disk_usage(self.directory).free
            return SwapError(f"no space for the swap file {self.path}: it needs {needed:,} bytes and "
                             f"{free:,} are free on its file system; free space or choose another nvme_path")
        return SwapError(f"cannot write the swap file {self.path}: {error.strerror}")

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.blocks.shutdown(wait=True)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _open_private(path: Path) -> tuple[int, bool]:
    """Open `path` for direct I/O if the file system allows it, and unlink it at once."""
    if not path.parent.is_dir():
        raise SwapError(f"nvme_path {path.parent} is not a directory: create it, or point "
                        "offload_optimizer.nvme_path at a directory on the NVMe drive")
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL
    try:
        try:
            fd, direct = os.open(path, flags | getattr(os, "O_DIRECT", 0), 0o600), hasattr(os, "O_DIRECT")
        except OSError as error:
            if error.errno != errno.EINVAL:  # EINVAL: the file system has no direct I/O (tmpfs)
                raise
            fd, direct = os.open(path, flags, 0o600), False
    except OSError as error:
        raise SwapError(f"cannot create a swap file in nvme_path {path.parent}: {error.strerror}; "
                        "choose a directory this process can write to") from None
    os.unlink(path)
    return fd, direct
