"""gloo's own reduce-scatter / all-gather beside shardwise's point-to-point versions.

Why `Communicator` does not call gloo's reduce-scatter and all-gather: torch's gloo backend
runs them through a full-size copy and an all-reduce. This times, per collective, the
median of a few calls on the same tensor, at 2 and 4 ranks:

    .venv/bin/python benchmarks/gloo_collectives.py [--elements 25000000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from shardwise.runtime.distributed.collectives import Communicator
from shardwise.runtime.distributed.setup import init_distributed
from shardwise.tools.testing import run_distributed
from shardwise.runtime.base.torch_compat import all_gather_single, reduce_scatter_single

REPEATS = 5


def _time(fn) -> float:
    fn()
    times = []
    for _ in range(REPEATS):
        dist.barrier()
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def _measure(rank: int, world: int, elements: int) -> dict[str, float]:
    comm = Communicator(init_distributed())
    full = torch.randn(elements - elements % world)
    chunk = full.chunk(world)[rank]
    out = torch.empty_like(chunk)
    return {
        "all_reduce (gloo)": _time(lambda: dist.all_reduce(full)),
        "reduce_scatter (gloo)": _time(lambda: reduce_scatter_single(out, full)),
        "reduce_scatter (shardwise)": _time(lambda: comm.reduce_scatter(out, full, "bench").wait()),
        "all_gather (gloo)": _time(lambda: all_gather_single(full, chunk.clone())),
        "all_gather (shardwise)": _time(lambda: comm.all_gather(full, chunk, "bench").wait()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=25_000_000, help="fp32 elements per collective")
    args = parser.parse_args()
    print(f"fp32 elements: {args.elements:,}; load average {os.getloadavg()}")
    print("| collective | 2 ranks ms | 4 ranks ms |")
    print("|---|---|---|")
    results = {world: run_distributed(_measure, world, args.elements, timeout=600)[0] for world in (2, 4)}
    for name in results[2]:
        print(f"| {name} | {results[2][name]:.1f} | {results[4][name]:.1f} |")


if __name__ == "__main__":
    main()
