"""Metrics of a token dataset for curriculum learning's offline index, written as DeepSpeed
0.19.8's DataAnalyzer writes it (shardwise/runtime/data/metric_index.py). Computed from a
token dataset (rows of token ids):

    seqlen   tokens in the sample, not counting `pad_id` where one is given (the
             difficulty of DeepSpeed's sequence-length curriculum that reorders data).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from shardwise.runtime.data.indexed_dataset import IndexedDataset


def seqlen(rows: list[np.ndarray], pad_id: int | None = None) -> np.ndarray:
    if pad_id is None:
        return np.asarray([len(row) for row in rows], dtype=np.int64)
    return np.asarray([int(np.count_nonzero(row != pad_id)) for row in rows], dtype=np.int64)


METRICS: dict[str, Callable[..., np.ndarray]] = {"seqlen": seqlen}


def token_rows(dataset: str | Path) -> list[np.ndarray]:
    """The samples of a token dataset: a `.npy` array (one row per sample) or the prefix
    of an MMIDIDX pair (PREFIX.bin / PREFIX.idx, Megatron's and DeepSpeed's format)."""
    path = Path(dataset)
    if path.suffix == ".npy":
        array = np.load(path)
        if array.ndim != 2:
            raise ValueError(f"{path} holds an array of shape {array.shape}: give one row of token ids per sample")
        return list(array)
    if Path(f"{dataset}.idx").is_file():
        return IndexedDataset(dataset)[:]
    raise ValueError(f"{dataset} is neither a .npy array nor the prefix of a PREFIX.bin / PREFIX.idx indexed "
                     "dataset")
