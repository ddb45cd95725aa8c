"""`deepspeed.runtime.data_pipeline.data_sampling.indexed_dataset`: the memory-mapped
indexed dataset (MMIDIDX, shardwise/runtime/data/indexed_dataset.py) under DeepSpeed's
names: a reader taking the files' prefix, a builder taking the .bin path and finalized
with the .idx path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from shardwise.runtime.data.indexed_dataset import DTYPES, IndexedDataset, IndexedDatasetWriter

__all__ = ["MMapIndexedDataset", "MMapIndexedDatasetBuilder", "valid_dtypes"]

valid_dtypes = {np.dtype(dtype).type for dtype in DTYPES.values()} | {
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64}


class MMapIndexedDataset(IndexedDataset):
    def __init__(self, path: str, skip_warmup: bool = False):  # nothing to warm up: the files are memory-mapped
        super().__init__(path)

    @staticmethod
    def exists(path: str) -> bool:
        return Path(f"{path}.idx").is_file() and Path(f"{path}.bin").is_file()


def _numpy_dtype(dtype: Any) -> np.dtype:
    return torch.empty(0, dtype=dtype).numpy().dtype if isinstance(dtype, torch.dtype) else np.dtype(dtype)


class MMapIndexedDatasetBuilder:
    """DeepSpeed's builder: rows from tensors or arrays into `out_file` (PREFIX.bin);
    `finalize(PREFIX.idx)` writes the index."""

    def __init__(self, out_file: str, dtype: Any = np.int64):
        if not str(out_file).endswith(".bin"):
            raise ValueError(f"MMapIndexedDatasetBuilder writes PREFIX.bin; got {out_file!r}")
        self._prefix = str(out_file)[: -len(".bin")]
        self._writer = IndexedDatasetWriter(self._prefix, _numpy_dtype(dtype))

    def add_item(self, tensor: torch.Tensor) -> None:
        self._writer.add(tensor.numpy())

    def add_item_numpy(self, np_array: np.ndarray) -> None:
        self._writer.add(np_array)

    def add_items(self, arr_list: list[np.ndarray]) -> None:
        for array in arr_list:
            self._writer.add(array)

    def end_document(self) -> None:
        self._writer.end_document()

    def merge_file_(self, another_file: str) -> None:
        """Append the rows (and documents) of the dataset `another_file` (a prefix)."""
        self._writer.append(IndexedDataset(another_file))

    def finalize(self, index_file: str) -> None:
        if str(index_file) != f"{self._prefix}.idx":
            raise ValueError(f"the index of {self._prefix}.bin is {self._prefix}.idx; got {index_file!r}")
        self._writer.finish()
