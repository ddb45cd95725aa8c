"""`shardwise data analyze` writes DeepSpeed's DataAnalyzer files: byte for byte what
DeepSpeed 0.19.8 writes for the same dataset (with DEEPSPEED_PYTHON set), readable back as
the index the curriculum sampler reads."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from shardwise.runtime.data.indexed_dataset import IndexedDataset
from shardwise.tools.cli.main import main as shardwise_main

FILES = ("sample_to_metric", "index_to_sample", "index_to_metric", "index_to_sample_percentile_merged")


def tokens(path: Path) -> np.ndarray:
    """30 samples of 12 token ids, padded with 0 after a length that repeats."""
    rng = np.random.default_rng(3)
    rows = rng.integers(1, 50, size=(30, 12))
    for i, length in enumerate((np.arange(30) * 5) % 13):
        rows[i, length:] = 0
    np.save(path, rows)
    return rows


def test_the_index_holds_each_sample_under_its_length(tmp_path):
    rows = tokens(tmp_path / "tokens.npy")
    assert shardwise_main(["data", "analyze", "--metric", "seqlen", "--pad-id", "0", str(tmp_path / "tokens.npy"),
                           str(tmp_path / "out")]) == 0
    prefix = tmp_path / "out" / "seqlen" / "seqlen"
    lengths = (rows != 0).sum(axis=1)
    values = [int(v[0]) for v in IndexedDataset(f"{prefix}_index_to_metric")[:]]
    samples = [list(s) for s in IndexedDataset(f"{prefix}_index_to_sample")[:]]
    assert values == sorted(set(lengths.tolist()))
    assert samples == [list(np.flatnonzero(lengths == v)) for v in values]
    assert [int(v[0]) for v in IndexedDataset(f"{prefix}_sample_to_metric")[:]] == lengths.tolist()
    assert IndexedDataset(f"{prefix}_index_to_sample").dtype == np.uint8


def test_vocab_rarity_is_the_recipes_sum_of_negative_log_frequencies(tmp_path):
    """The Megatron data-efficiency recipe's metric, written out in torch float64 as it
    computes it: counts over the dataset (pad excluded, unseen ids counted once), -ln of
    their share, summed over each sample's tokens and cut to an integer."""
    import torch

    rows = tokens(tmp_path / "tokens.npy")
    assert shardwise_main(["data", "analyze", "--metric", "vocab_rarity", "--pad-id", "0", "--vocab-size", "64",
                           str(tmp_path / "tokens.npy"), str(tmp_path / "out")]) == 0
    text = torch.from_numpy(rows)
    mask = (text != 0).double()
    counts = torch.bincount(text.view(-1), minlength=64, weights=mask.view(-1))
    counts[counts == 0] = 1
    rarity = -torch.log(counts / counts.sum())
    expected = torch.sum(mask * rarity[text], dim=1).to(torch.long).tolist()
    prefix = tmp_path / "out" / "vocab_rarity" / "vocab_rarity"
    assert [int(v[0]) for v in IndexedDataset(f"{prefix}_sample_to_metric")[:]] == expected


DEEPSPEED_SIDE = r"""
import sys
import numpy as np
import torch
from deepspeed.runtime.data_pipeline.data_sampling.data_analyzer import DataAnalyzer
rows = torch.from_numpy(np.load(sys.argv[1]))
analyzer = DataAnalyzer(rows, batch_size=4, metric_names=["seqlen"],
                        metric_functions=[lambda batch: (batch != 0).sum(dim=1)],
                        metric_types=["single_value_per_sample"], metric_dtypes=[torch.int64], save_path=sys.argv[2])
analyzer.run_map()
analyzer.run_reduce()
"""


@pytest.mark.skipif(not os.environ.get("DEEPSPEED_PYTHON"), reason="set DEEPSPEED_PYTHON to an interpreter with "
                    "DeepSpeed installed (benchmarks/zero3_vs_fsdp2_deepspeed.py's docstring shows one)")
def test_files_equal_deepspeeds_data_analyzer(tmp_path):
    tokens(tmp_path / "tokens.npy")
    subprocess.run([os.environ["DEEPSPEED_PYTHON"], "-c", DEEPSPEED_SIDE, str(tmp_path / "tokens.npy"),
                    str(tmp_path / "ds")], check=True, capture_output=True, text=True, timeout=300,
                   env={**os.environ, "DS_ACCELERATOR": "cpu"})
    shardwise_main(["data", "analyze", "--metric", "seqlen", "--pad-id", "0", str(tmp_path / "tokens.npy"),
                    str(tmp_path / "ours")])
    for name in FILES:
        for suffix in (".bin", ".idx"):
            ours = (tmp_path / "ours" / "seqlen" / f"seqlen_{name}{suffix}").read_bytes()
            theirs = (tmp_path / "ds" / "seqlen" / f"seqlen_{name}{suffix}").read_bytes()
            assert ours == theirs, f"{name}{suffix}"
