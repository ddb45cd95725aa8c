"""`shardwise data analyze`: the offline metric index curriculum learning samples by.

    shardwise data analyze --metric seqlen|vocab_rarity [--pad-id 0] [--vocab-size V] DATASET OUT

DATASET is a `.npy` array of token ids (one row per sample) or the prefix of a
PREFIX.bin / PREFIX.idx indexed dataset; OUT/METRIC/ receives DeepSpeed's DataAnalyzer
files (shardwise/tools/data/analyze.py), which the config's curriculum metric names as
`index_to_sample_path` and `index_to_metric_path`.
"""

from __future__ import annotations

import argparse
from typing import Any

from shardwise.runtime.data.metric_index import write_metric_index
from shardwise.tools.data.analyze import METRICS, token_rows


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("data", help="offline data tools (curriculum learning's metric index)",
                                   description=__doc__.splitlines()[0])
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    analyze = actions.add_parser("analyze", help="write a metric's index_to_sample / index_to_metric files")
    analyze.add_argument("--metric", choices=sorted(METRICS), required=True)
    analyze.add_argument("--pad-id", type=int, default=None, help="a token id not counted")
    analyze.add_argument("--vocab-size", type=int, default=None,
                         help="vocab_rarity: the vocabulary's size (default: the largest id + 1)")
    analyze.add_argument("dataset", help="a .npy array of token ids, or an indexed dataset's prefix")
    analyze.add_argument("out", help="folder; the files go to OUT/METRIC/")
    parser.set_defaults(handler=main)
    return parser


def main(args: argparse.Namespace) -> int:
    values = METRICS[args.metric](token_rows(args.dataset), pad_id=args.pad_id, vocab_size=args.vocab_size)
    folder = write_metric_index(values, args.out, args.metric)
    prefix = folder / args.metric
    print(f"index_to_sample_path: {prefix}_index_to_sample\nindex_to_metric_path: {prefix}_index_to_metric")
    return 0
