"""What every rank of `shardwise train` runs: `python -m shardwise.train.worker OPTIONS_JSON`.

Started by `shardwise.train.launch` through torchrun, which provides the rendezvous
environment that `shardwise.initialize` reads, and OMP_NUM_THREADS, which sets how many
threads torch uses in this rank.
"""

from __future__ import annotations

import sys

import torch.distributed as dist

from shardwise.train.compare import compare_stages
from shardwise.train.loop import train
from shardwise.train.options import TrainOptions


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m shardwise.train.worker OPTIONS_JSON", file=sys.stderr)
        return 2
    options = TrainOptions.load(argv[0])
    try:
        if options.compare_stages:
            compare_stages(options)
        else:
            train(options)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
