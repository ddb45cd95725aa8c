"""8-bit Adam's native kernel alone, several builds of native_kernels.c side by side (issue 27).

    .venv/bin/python benchmarks/adam8bit_kernel.py [BUILD ...] [--elements 4194304] [--repeats 30]

Each BUILD is a C file, or `git:REV` for shardwise/runtime/optim/native_kernels.c at a git
revision; default: the working tree's. Each is compiled with optim/native.py's flags and
its `adam8bit_step` run on one piece of `--elements` elements from the same coded state
(random codes, scales in [0.5, 1.5)), one thread, builds alternating call by call; printed
is each build's least CPU time over `--repeats` calls, and per 10.84M elements (the
shard of benchmarks/optimizer_step.py). The least time of alternated calls is what a
loaded machine disturbs least, and without optimizer_step.py's 76 tensors and Python per
tensor it shows the kernel's own cost, to compare variants of it (a decode or encode left
out, say). Builds must take the codebook of this tree's optim/adam8bit.py, whose first
words are the code values and the rounding cells as every revision since the kernel's has
them.
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from shardwise.runtime.optim import native
from shardwise.runtime.optim.adam8bit import _native_codebook

SHARD = 10.84e6  # elements of benchmarks/optimizer_step.py's shard


def build(source: str, scratch: Path, index: int) -> ctypes.CDLL:
    """The compiled kernels of a C file or of `git:REV`."""
    if source.startswith("git:"):
        text = subprocess.run(["git", "show", f"{source[4:]}:shardwise/runtime/optim/native_kernels.c"],
                              capture_output=True, text=True, check=True).stdout
        source = str(scratch / f"kernels{index}.c")
        Path(source).write_text(text)
    library = scratch / f"kernels{index}.so"
    subprocess.run(["cc", *native.FLAGS, "-fopenmp", source, "-o", str(library), "-lm"], check=True)
    kernels = ctypes.CDLL(str(library))  # only the kernel timed here: other revisions have other kernels
    kernels.adam8bit_step.argtypes, kernels.adam8bit_step.restype = native._SIGNATURES["adam8bit_step"], None
    return kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("builds", nargs="*", default=[str(native.SOURCE)])
    parser.add_argument("--elements", type=int, default=1 << 22)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    n = args.elements
    generator = torch.Generator().manual_seed(0)
    param, grad = torch.randn(n, generator=generator), torch.randn(n, generator=generator)
    state = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=generator),
             torch.rand((n + 255) // 256, generator=generator) + 0.5,
             torch.randint(0, 256, (n,), dtype=torch.uint8, generator=generator),
             torch.rand((n + 255) // 256, generator=generator) + 0.5]
    books = [table.data_ptr() for signed in (True, False) for table in _native_codebook(signed)]
    edges = torch.empty(2, 2, 256)
    with tempfile.TemporaryDirectory() as scratch:
        libraries = [build(source, Path(scratch), index) for index, source in enumerate(args.builds)]
        best = [float("inf")] * len(libraries)
        weights, coded = param.clone(), [tensor.clone() for tensor in state]  # written in place, reset per call
        for _ in range(args.repeats):
            for index, library in enumerate(libraries):
                weights.copy_(param)
                for tensor, start_state in zip(coded, state):
                    tensor.copy_(start_state)
                start = time.process_time()
                library.adam8bit_step(weights.data_ptr(), grad.data_ptr(), *(t.data_ptr() for t in coded), n, 0,
                                      *books, 0.9, 0.1, 0.999, 0.001, 1e-8, 1.0, 0, 1.0, -1e-3, edges.data_ptr(),
                                      None, None, 1)
                best[index] = min(best[index], time.process_time() - start)
    print(f"{n} elements, one thread, least CPU time of {args.repeats} alternated calls")
    print("| build | ms | ms per 10.84M elements |")
    print("|---|---|---|")
    for source, seconds in zip(args.builds, best):
        print(f"| {source} | {seconds * 1e3:.2f} | {seconds * 1e3 * SHARD / n:.2f} |")


if __name__ == "__main__":
    main()
