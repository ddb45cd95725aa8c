"""Muon's Newton-Schulz iterations against this CPU's matrix-product FLOP/s, per matrix
shape of the main job's GPT, in one run (issue 27: at least 60% of measured matmul FLOP/s).

    .venv/bin/python benchmarks/muon_newton_schulz.py [--model-size 10m] [--threads 1] [--repeats 5]

Newton-Schulz is three matrix products per iteration on the wide orientation X (r x c,
r <= c): A = X Xᵀ (2r²c FLOPs), B = bA + cA² (2r³), X <- aX + BX (2r²c). Its FLOP/s, from
the median CPU time of `orthogonalize` (optim/muon.py, five iterations), is divided by
the FLOP/s of one plain product X Xᵀ of the same matrix and dtype measured beside it:
the rate this CPU's BLAS reaches on that shape, which is what the iterations could reach.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable

import torch

from shardwise.models import GPT, GPTConfig
from shardwise.runtime.optim.muon import NS_COEFFICIENTS, NS_DTYPES, orthogonalize

STEPS = 5


def cpu_seconds(function: Callable[[], object], repeats: int) -> float:
    function()
    times = []
    for _ in range(repeats):
        started = time.process_time()
        function()
        times.append(time.process_time() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-size", default="10m")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shapes = sorted({tuple(p.shape) for p in GPT(GPTConfig.preset(args.model_size)).parameters() if p.dim() == 2})
    print(f"{args.threads} thread(s), median of {args.repeats}; load average "
          f"{' '.join(f'{load:.1f}' for load in os.getloadavg())}")
    print("| matrix | dtype | Newton-Schulz ms | its GFLOP/s | X Xᵀ GFLOP/s | fraction |")
    print("|---|---|---|---|---|---|")
    for shape in shapes:
        generator = torch.Generator().manual_seed(0)
        matrix = torch.randn(shape, generator=generator)
        rows, cols = min(shape), max(shape)
        flops = STEPS * (4 * rows * rows * cols + 2 * rows**3)
        for name, dtype in NS_DTYPES.items():
            seconds = cpu_seconds(lambda: orthogonalize(matrix, NS_COEFFICIENTS, STEPS, 1e-7, dtype), args.repeats)
            wide = matrix.to(dtype).T.contiguous() if shape[0] > shape[1] else matrix.to(dtype)
            product = cpu_seconds(lambda: wide @ wide.T, args.repeats)
            rate, peak = flops / seconds, 2 * rows * rows * cols / product
            print(f"| {shape[0]}x{shape[1]} | {name} | {seconds * 1e3:.1f} | {rate / 1e9:.1f} | {peak / 1e9:.1f} "
                  f"| {rate / peak:.0%} |")


if __name__ == "__main__":
    main()
