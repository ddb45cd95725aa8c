"""Block-sparse attention (shardwise.runtime.ops.sparse_attention) vs dense masked SDPA on CPU (issue 15).

Forward + backward of one attention call, batch 1, 8 heads of width 64, BigBird's default
layout (block 16, 1 random block, a 3-block window, 1 global block, bidirectional) at
sequence lengths 1k-16k. Dense is torch's `scaled_dot_product_attention` with the layout
expanded to an L x L boolean mask (built inside the timed call: it is what dense attention
needs to express the same pattern).

Each (implementation, length) runs in two fresh processes with one intra-op thread (the
machine's 2 cores are shared with other jobs, and a second OpenMP thread that is not
scheduled makes every parallel region wait): one for the time, one for memory with
MALLOC_MMAP_THRESHOLD_=65536, so that every large tensor is its own mapping returned to
the system when freed and the peak resident memory (VmHWM, reset through
/proc/self/clear_refs before the measured call) is the peak of live tensors (mapping each
allocation afresh costs page faults, hence the separate timing run). Reported: the peak
above the inputs, and the "working" part of it, i.e. less the output and the three input
gradients that any attention implementation returns.

    .venv/bin/python benchmarks/sparse_attention.py            # all lengths, table + plot
    .venv/bin/python benchmarks/sparse_attention.py --lengths 1024 2048 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
BATCH, HEADS, DIM, BLOCK = 1, 8, 64, 16
MIB = 1024 * 1024


def _status(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) * 1024 / MIB
    raise RuntimeError(f"{field} not in /proc/self/status")


def measure(impl: str, length: int, repeats: int) -> dict:
    """One implementation at one length, in this process."""
    import random

    import torch
    import torch.nn.functional as F

    from shardwise.runtime.ops.sparse_attention import BigBirdSparsityConfig, SparseSelfAttention

    torch.set_num_threads(1)
    random.seed(0)
    torch.manual_seed(0)
    attention = SparseSelfAttention(BigBirdSparsityConfig(HEADS, block=BLOCK), max_seq_length=length)
    layout = attention.get_layout(length)[0].bool()
    q, k, v = (torch.randn(BATCH, HEADS, length, DIM, requires_grad=True) for _ in range(3))
    grad = torch.randn(BATCH, HEADS, length, DIM)

    def step() -> None:
        if impl == "sparse":
            out = attention(q, k, v)
        else:
            mask = layout.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out.backward(grad)
        q.grad = k.grad = v.grad = None

    step()  # warm-up: plan building, allocator, thread pool
    Path("/proc/self/clear_refs").write_text("5")
    before = _status("VmRSS")
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    peak = _status("VmHWM") - before
    returned = 4 * BATCH * HEADS * length * DIM * 4 / MIB  # output + dq, dk, dv in fp32
    plan = attention.plan(length, False, DIM)
    return {"impl": impl, "length": length, "seconds": min(times), "peak_mib": peak,
            "working_mib": max(peak - returned, 0.0), "kept_fraction": plan.kept_blocks() / (HEADS * plan.blocks ** 2),
            "threads": torch.get_num_threads()}


def _subprocess(impl: str, length: int, repeats: int, env: dict) -> dict:
    out = subprocess.run([sys.executable, __file__, "--one", impl, str(length), "--repeats", str(repeats)],
                         env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def run_isolated(impl: str, length: int, repeats: int) -> dict:
    timed = _subprocess(impl, length, repeats, dict(os.environ))
    memory = _subprocess(impl, length, 1, {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})
    return {**memory, "seconds": timed["seconds"]}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for impl, style in (("dense", "o-"), ("sparse", "s-")):
        mine = sorted((r for r in rows if r["impl"] == impl), key=lambda r: r["length"])
        lengths = [r["length"] for r in mine]
        label = "dense masked SDPA" if impl == "dense" else "block-sparse (BigBird)"
        left.plot(lengths, [r["seconds"] for r in mine], style, label=label)
        right.plot(lengths, [r["peak_mib"] for r in mine], style, label=label)
    for axis, title in ((left, "forward + backward time (s)"), (right, "peak memory above inputs (MiB)")):
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("sequence length")
        axis.set_title(title)
        axis.grid(True, which="both", alpha=0.3)
        axis.legend()
    fig.suptitle(f"attention, batch {BATCH}, {HEADS} heads x {DIM}, block {BLOCK}, CPU (shared machine)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--one", nargs=2, metavar=("IMPL", "LENGTH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one[0], int(args.one[1]), args.repeats)))
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from report import machine_line

    rows = [run_isolated(impl, length, args.repeats) for length in args.lengths for impl in ("dense", "sparse")]
    print(machine_line() + "; 1 intra-op thread per measurement")
    print("| length | kept blocks | dense s | sparse s | speed-up | dense peak MiB | sparse peak MiB | ratio "
          "| dense working MiB | sparse working MiB | ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for length in args.lengths:
        dense, sparse = (next(r for r in rows if r["impl"] == i and r["length"] == length) for i in ("dense", "sparse"))
        print(f"| {length} | {sparse['kept_fraction']:.1%} | {dense['seconds']:.3f} | {sparse['seconds']:.3f} "
              f"| {dense['seconds'] / sparse['seconds']:.1f}x | {dense['peak_mib']:.0f} | {sparse['peak_mib']:.0f} "
              f"| {dense['peak_mib'] / max(sparse['peak_mib'], 1e-9):.1f}x | {dense['working_mib']:.0f} "
              f"| {sparse['working_mib']:.0f} | {dense['working_mib'] / max(sparse['working_mib'], 1e-9):.1f}x |")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "sparse_attention.json").write_text(json.dumps(rows, indent=1) + "\n")
    plot(rows, RESULTS / "sparse_attention.png")
    print(f"plot: {RESULTS / 'sparse_attention.png'}")


if __name__ == "__main__":
    main()
