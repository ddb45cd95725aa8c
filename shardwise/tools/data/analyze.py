"""Metrics of a token dataset for curriculum learning's offline index, written as DeepSpeed
0.19.8's DataAnalyzer writes it (shardwise/runtime/data/metric_index.py). Computed from a
token dataset (rows of token ids):

    seqlen        tokens in the sample, not counting `pad_id` where one is given (the
                  difficulty of DeepSpeed's sequence-length curriculum that reorders data);
    vocab_rarity  the sum over the sample's tokens (not counting `pad_id`) of -ln(f / F),
                  f the token's count over the whole dataset (counted as 1 where it is 0)
                  and F the sum of those counts over the vocabulary (`vocab_size` ids,
                  default the largest id + 1), in float64, rounded down: the metric of
                  DeepSpeed's Megatron data-efficiency recipe (analyze_data.py's
                  `vocab_rarity` over its `total_vocab_freq`), done in one pass here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from shardwise.runtime.data.indexed_dataset import IndexedDataset


def seqlen(rows: list[np.ndarray], *, pad_id: int | None = None, vocab_size: int | None = None) -> np.ndarray:
    if pad_id is None:
        return np.asarray([len(row) for row in rows], dtype=np.int64)
    return np.asarray([int(np.count_nonzero(row != pad_id)) for row in rows], dtype=np.int64)


def vocab_rarity(rows: list[np.ndarray], *, pad_id: int | None = None, vocab_size: int | None = None) -> np.ndarray:
    kept = [np.asarray(row, dtype=np.int64) for row in rows]
    if pad_id is not None:
        kept = [row[row != pad_id] for row in kept]
    tokens = np.concatenate(kept) if kept else np.zeros(0, dtype=np.int64)
    size = vocab_size if vocab_size is not None else (int(tokens.max()) + 1 if len(tokens) else 1)
    if len(tokens) and (tokens.min() < 0 or tokens.max() >= size):
        raise ValueError(f"token ids run from {tokens.min()} to {tokens.max()}, outside a vocabulary of {size}: give "
                         "--vocab-size at least the largest id + 1")
    counts = np.bincount(tokens, minlength=size).astype(np.float64)
    counts[counts == 0] = 1  # an unseen id, as the recipe counts it (no log of 0)
    rarity = -np.log(counts / counts.sum())
    return np.asarray([int(rarity[row].sum()) for row in kept], dtype=np.int64)


METRICS: dict[str, Callable[..., np.ndarray]] = {"seqlen": seqlen, "vocab_rarity": vocab_rarity}


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
