"""Megatron's memory-mapped indexed dataset (MMIDIDX), the file format of DeepSpeed's
curriculum metric index (`index_to_sample`, `index_to_metric`) and its data clusters.

A dataset `PREFIX` is two files: `PREFIX.bin` holds the rows' elements back to back,
`PREFIX.idx` the header and where each row starts. The index, as DeepSpeed 0.19.8 writes
and reads it (deepspeed/runtime/data_pipeline/data_sampling/indexed_dataset.py):

    b"MMIDIDX\\x00\\x00"   9-byte magic
    <Q  1                 version
    <B  dtype code        1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 uint16, 7 uint32, 8 uint64
    <Q  rows              number of rows
    <Q  documents + 1     length of the document index
    int32[rows]           elements per row
    int64[rows]           byte offset of each row in the .bin file
    int64[documents + 1]  first row of each document (0 first)

The files are shared with DeepSpeed both ways: a metric index written by DeepSpeed's
DataAnalyzer is read here, and one written by `shardwise data analyze` is read by DeepSpeed.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPES: dict[int, type[np.generic]] = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.uint16, 7: np.uint32, 8: np.uint64,
}
CODES = {np.dtype(dtype): code for code, dtype in DTYPES.items()}


def smallest_int_dtype(low: int, high: int) -> type[np.generic]:
    """The narrowest dtype holding every integer in [low, high], as DeepSpeed chooses it
    (unsigned when low >= 0): the dtype of its sample indices and cluster files."""
    if low >= 0:
        for dtype in (np.uint8, np.uint16, np.uint32):
            if high <= np.iinfo(dtype).max:
                return dtype
        return np.uint64
    for dtype in (np.int8, np.int16, np.int32):
        if np.iinfo(dtype).min <= low and high <= np.iinfo(dtype).max:
            return dtype
    return np.int64


class IndexedDataset:
    """Read-only rows of a PREFIX.bin / PREFIX.idx pair, memory-mapped: `dataset[i]` is
    row i as a numpy array (a view of the file), `dataset[a:b]` a list of rows."""

    def __init__(self, prefix: str | Path):
        self.prefix = str(prefix)
        index = Path(f"{self.prefix}.idx").read_bytes()
        if index[:9] != MAGIC:
            raise ValueError(f"{self.prefix}.idx is not a memory-mapped indexed dataset (no MMIDIDX header): give "
                             "the prefix of a file pair written by DeepSpeed's DataAnalyzer or `shardwise data "
                             "analyze`")
        version, code, rows, documents = struct.unpack_from("<QBQQ", index, 9)
        if version != VERSION or code not in DTYPES:
            raise ValueError(f"{self.prefix}.idx has version {version} and dtype code {code}; only version 1 with "
                             f"codes {sorted(DTYPES)} exist")
        offset = 9 + struct.calcsize("<QBQQ")
        self.dtype = np.dtype(DTYPES[code])
        self.sizes = np.frombuffer(index, dtype=np.int32, count=rows, offset=offset)
        self.pointers = np.frombuffer(index, dtype=np.int64, count=rows, offset=offset + 4 * rows)
        self.doc_idx = np.frombuffer(index, dtype=np.int64, count=documents, offset=offset + 12 * rows)
        size = Path(f"{self.prefix}.bin").stat().st_size
        self._data = np.memmap(f"{self.prefix}.bin", mode="r", dtype=np.uint8) if size else np.zeros(0, np.uint8)

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, item: int | slice) -> np.ndarray | list[np.ndarray]:
        if isinstance(item, slice):
            start, stop, step = item.indices(len(self))
            return [self[row] for row in range(start, stop, step)]
        row = range(len(self))[item]
        start = int(self.pointers[row])
        return self._data[start: start + int(self.sizes[row]) * self.dtype.itemsize].view(self.dtype)


class IndexedDatasetWriter:
    """Writes rows, each `end_document()` closes a document, `finish()` writes the index.
    DeepSpeed closes its builders with one `end_document()` (document index [0, rows]); the
    files its DataAnalyzer merges from one reduce chunk carry the chunk's document end too
    ([0, rows, rows]), which `write_rows(merged=True)` reproduces byte for byte."""

    def __init__(self, prefix: str | Path, dtype: type[np.generic] | np.dtype):
        self.prefix = str(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODES:
            raise ValueError(f"indexed datasets hold {', '.join(str(np.dtype(d)) for d in DTYPES.values())}; "
                             f"got {self.dtype}")
        self._data = open(f"{self.prefix}.bin", "wb")
        self._sizes: list[int] = []
        self._documents = [0]

    def add(self, row: np.ndarray) -> None:
        values = np.ascontiguousarray(np.asarray(row).reshape(-1).astype(self.dtype, copy=False))
        self._data.write(values.tobytes())
        self._sizes.append(values.size)

    def end_document(self) -> None:
        self._documents.append(len(self._sizes))

    def append(self, other: IndexedDataset) -> None:
        """Every row and document end of `other` after those written so far."""
        if other.dtype != self.dtype:
            raise ValueError(f"{other.prefix} holds {other.dtype}, this writer {self.dtype}")
        offset = len(self._sizes)
        for row in range(len(other)):
            self.add(other[row])
        self._documents.extend(int(end) + offset for end in other.doc_idx[1:])

    def finish(self) -> None:
        self._data.close()
        sizes = np.asarray(self._sizes, dtype=np.int64)
        pointers = np.zeros(len(sizes), dtype=np.int64)
        if len(sizes) > 1:
            pointers[1:] = np.cumsum(sizes[:-1] * self.dtype.itemsize)
        documents = np.asarray(self._documents, dtype=np.int64)
        with open(f"{self.prefix}.idx", "wb") as index:
            index.write(MAGIC)
            index.write(struct.pack("<QBQQ", VERSION, CODES[self.dtype], len(sizes), len(documents)))
            index.write(sizes.astype(np.int32).tobytes())
            index.write(pointers.tobytes())
            index.write(documents.tobytes())


def write_rows(prefix: str | Path, rows: list[np.ndarray], dtype: type[np.generic] | np.dtype, *,
               merged: bool = False) -> None:
    writer = IndexedDatasetWriter(prefix, dtype)
    for row in rows:
        writer.add(row)
    for _ in range(1 + merged):
        writer.end_document()
    writer.finish()
