"""safetensors files written as a stream and read by element range.

`safetensors.torch.save_file` needs every tensor of a file in one dict in memory and
refuses views that share a storage (a rank's pieces are views into one flat chunk);
`safe_open` memory-maps the file, so every page a loader touches stays in its resident
set until the file is closed. Checkpoints need the opposite on both sides: a rank writes
its pieces straight from the chunks it already holds, hashing the bytes on the way out
(the manifest's checksum costs no second read), and a loader reads exactly the elements
it now owns into its own buffers. The format is small enough to do both here: an 8-byte
little-endian header length, a JSON header of name -> dtype, shape, byte offsets, then
the data back to back. The files are ordinary safetensors (`safe_open` and
`transformers` read them).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from shardwise.runtime.checkpoint.format import CheckpointError, disk_full_error

DTYPE_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in DTYPE_NAMES:
        raise CheckpointError(f"tensors of dtype {dtype} cannot be stored in a checkpoint")
    return DTYPE_NAMES[dtype]


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


class SafetensorsWriter:
    """Writes the planned tensors in plan order; a tensor may arrive in several parts.

    The header (with every offset) must come first, so the caller plans names, dtypes and
    shapes up front; then `write` streams the data. `close` returns (bytes, sha256).
    """

    def __init__(self, path: Path, entries: list[TensorEntry], metadata: dict[str, str] | None = None):
        header: dict[str, object] = {}
        offset = 0
        for entry in entries:
            header[entry.name] = {
                "dtype": dtype_name(entry.dtype),
                "shape": list(entry.shape),
                "data_offsets": [offset, offset + entry.nbytes],
            }
            offset += entry.nbytes
        if metadata:
            header["__metadata__"] = metadata
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # data starts 8-byte aligned
        self.path = path
        self.total_bytes = 8 + len(text) + offset
        self._file = open(path, "wb")
        self._hash = hashlib.sha256()
        self._size = 0
        self._pending = list(reversed(entries))
        self._remaining = 0  # bytes still due for the entry being written
        try:
            self._emit(struct.pack("<Q", len(text)) + text)
        except BaseException:
            self.abort()
            raise

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append `tensor`'s elements to entry `name` (the next one due, or the current one)."""
        if self._remaining == 0:
            if not self._pending or self._pending[-1].name != name:
                due = self._pending[-1].name if self._pending else "nothing"
                raise ValueError(f"{self.path}: got tensor {name!r} but {due!r} is due next")
            entry = self._pending.pop()
            self._current, self._remaining = entry, entry.nbytes
        elif name != self._current.name:
            raise ValueError(f"{self.path}: {self._current.name!r} is not complete, got {name!r}")
        if tensor.dtype != self._current.dtype:
            raise ValueError(f"{self.path}: {name!r} is {self._current.dtype}, got {tensor.dtype}")
        data = tensor.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy()
        if data.nbytes > self._remaining:
            raise ValueError(f"{self.path}: {name!r} got {data.nbytes - self._remaining} bytes too many")
        self._emit(data)
        self._remaining -= data.nbytes

    def close(self) -> tuple[int, str]:
        """Flush to disk (a published checkpoint must survive a power cut too)."""
        missing = [entry.name for entry in self._pending] + ([self._current.name] if self._remaining else [])
        if missing:
            self._file.close()
            raise ValueError(f"{self.path}: closed with tensors unwritten: {missing[:3]}")
        with self._naming_a_full_disk():
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
        return self._size, self._hash.hexdigest()

    def abort(self) -> None:
        try:
            self._file.close()
        except OSError:
            pass  # closing flushes what a failed write left buffered; that failure is already raised

    def _emit(self, data) -> None:
        with self._naming_a_full_disk():
            self._file.write(data)
        self._hash.update(data)
        self._size += memoryview(data).nbytes

    @contextmanager
    def _naming_a_full_disk(self) -> Iterator[None]:
        """A full disk surfaces as a bare ENOSPC from whichever write, flush or fsync hits it;
        say which file, how large it is and how much space is left instead."""
        try:
            yield
        except OSError as error:
            full = disk_full_error(error, self.path, self.total_bytes)
            if full is None:
                raise
            raise full from None

    def __enter__(self) -> "SafetensorsWriter":
        return self

    def __exit__(self, kind, error, trace) -> None:
        if kind is not None:
            self.abort()


class SafetensorsReader:
    """Reads any element range of a stored tensor with positioned reads, no memory map."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self._fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint file {path} is missing") from None
        try:
            length_bytes = os.pread(self._fd, 8, 0)
            (length,) = struct.unpack("<Q", length_bytes) if len(length_bytes) == 8 else (None,)
            header = json.loads(os.pread(self._fd, length, 8)) if length else None
        except (struct.error, json.JSONDecodeError, UnicodeDecodeError, OverflowError):
            header = None
        if not isinstance(header, dict):
            self.close()
            raise CheckpointError(f"{path} is not a safetensors file (unreadable header)")
        self.metadata = header.pop("__metadata__", {})
        self._data_start = 8 + length
        self.entries = {
            name: (TensorEntry(name, DTYPES[info["dtype"]], tuple(info["shape"])), info["data_offsets"][0])
            for name, info in header.items()
        }

    def entry(self, name: str) -> TensorEntry:
        if name not in self.entries:
            raise CheckpointError(f"{self.path} has no tensor {name!r}")
        return self.entries[name][0]

    def read_into(self, name: str, start: int, out: torch.Tensor) -> None:
        """Fill `out` (1-D, contiguous, on CPU, the stored dtype) with elements
        [start, start + out.numel()) of the flattened tensor `name`."""
        entry = self.entry(name)
        stop = start + out.numel()
        if out.dtype != entry.dtype or stop > entry.numel or start < 0:
            raise ValueError(f"{self.path}: cannot read {name}[{start}:{stop}] as {out.dtype} "
                             f"(stored: {entry.numel} elements of {entry.dtype})")
        buffer = memoryview(out.view(torch.uint8).numpy()).cast("B")
        position = self._data_start + self.entries[name][1] + start * entry.dtype.itemsize
        done = 0
        while done < len(buffer):
            count = os.preadv(self._fd, [buffer[done:]], position + done)
            if count == 0:
                raise CheckpointError(f"{self.path} ends inside tensor {name!r} (truncated)")
            done += count

    def read(self, name: str, start: int, stop: int) -> torch.Tensor:
        out = torch.empty(stop - start, dtype=self.entry(name).dtype)
        self.read_into(name, start, out)
        return out

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
