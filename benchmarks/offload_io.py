"""Offload against the machine's physical limits (issue 13, C11-C12).

    .venv/bin/python benchmarks/offload_io.py [--nvme-path DIR] [--elements 50000000]

1. The CPU optimizer step: torch's fused AdamW over an fp32 partition in `sub_group_size`
   pieces, as the host tier runs it. Bytes touched per element: read parameter, gradient
   and both moments (16), write parameter and moments (12). Compared with the memory
   bandwidth measured on the same machine by copying a large buffer (read + write).
   When `deepspeed` imports (a separate environment with DeepSpeed's CPU Adam built,
   `DS_BUILD_CPU_ADAM=1`; see BENCHMARKS.md), DeepSpeedCPUAdam runs the same step beside it.
2. NVMe: the swap file's paging bandwidth (write then read every page, as the optimizer
   phase does) against the disk's sequential direct-I/O bandwidth measured with `dd
   oflag=direct` / `iflag=direct` on the same path.
3. Peak RSS of a GPT trained with the optimizer state in memory and on NVMe (fresh
   processes each), against the optimizer state the NVMe tier moved out.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve()
REPO = SCRIPT.parent.parent
GB = 1e9


def memory_bandwidth(elements: int, repeats: int = 10) -> float:
    source = torch.randn(elements)
    target = torch.empty_like(source)
    target.copy_(source)
    best = min(_timed(lambda: target.copy_(source)) for _ in range(repeats))
    return 2 * source.numel() * 4 / best  # read + write


def optimizer_bandwidth(elements: int, sub_group_size: int, repeats: int = 10) -> tuple[float, float]:
    params = torch.nn.Parameter(torch.randn(elements))
    params.grad = torch.randn(elements)
    pieces = [torch.nn.Parameter(piece) for piece in params.detach().split(sub_group_size)]
    for piece, grad in zip(pieces, params.grad.split(sub_group_size)):
        piece.grad = grad
    optimizer = torch.optim.AdamW(pieces, lr=1e-4, fused=True)
    optimizer.step()  # creates the state
    seconds = min(_timed(optimizer.step) for _ in range(repeats))
    return 28 * elements / seconds, seconds


def deepspeed_bandwidth(elements: int, sub_group_size: int, repeats: int = 10) -> tuple[float, float] | None:
    """DeepSpeed's CPU Adam (AdamW mode) over the same pieces, or None where it is not installed."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except ImportError:
        return None
    params = torch.randn(elements)
    pieces = [torch.nn.Parameter(piece) for piece in params.split(sub_group_size)]
    for piece in pieces:
        piece.grad = torch.randn_like(piece)
    optimizer = DeepSpeedCPUAdam(pieces, lr=1e-4, adamw_mode=True)
    optimizer.step()  # creates the state
    seconds = min(_timed(optimizer.step) for _ in range(repeats))
    return 28 * elements / seconds, seconds


def dd_bandwidth(path: Path, megabytes: int) -> tuple[float, float]:
    target = path / "shardwise-dd-probe"
    try:
        write = _dd(["dd", "if=/dev/zero", f"of={target}", "bs=1M", f"count={megabytes}", "oflag=direct"])
        read = _dd(["dd", f"if={target}", "of=/dev/null", "bs=1M", "iflag=direct"])
    finally:
        target.unlink(missing_ok=True)
    return write, read


def _dd(command: list[str]) -> float:
    output = subprocess.run(command, capture_output=True, text=True, check=True).stderr
    match = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", output)
    return int(match.group(1)) / float(match.group(2))


def swap_bandwidth(path: Path, megabytes: int, page_elements: int) -> tuple[float, float]:
    from shardwise.runtime.zero.swap import SwapFile

    swap = SwapFile(path, rank=0, threads=1, queue_depth=8)  # DeepSpeed's aio defaults, as the engine's
    regions = [swap.region(page_elements, torch.float32) for _ in range(megabytes * 2**20 // (4 * page_elements))]
    swap.reserve()
    for region in regions:
        region.tensor.fill_(1.0)
    total = sum(region.nbytes for region in regions)
    write = total / _timed(lambda: [swap.write_all([region]).result() for region in regions])
    read = total / _timed(lambda: [swap.read_all([region]).result() for region in regions])
    swap.close()
    return write, read


def _timed(operation) -> float:
    started = time.perf_counter()
    operation()
    return time.perf_counter() - started


# -- peak RSS of a training run, in a fresh process ---------------------------------------------
def rss_worker(preset: str, device: str, nvme_path: str) -> None:
    import resource

    import shardwise
    from shardwise.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig.preset(preset))
    offload = {"device": device, "nvme_path": nvme_path} if device != "none" else {"device": "none"}
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              # 1M-element sub-groups: at most three 12 MB pages in memory (master + two moments)
              "zero_optimization": {"stage": 2, "offload_optimizer": offload, "sub_group_size": 1_000_000}}
    engine = shardwise.initialize(model, config)
    tokens = torch.randint(0, 256, (1, 129))
    for _ in range(3):
        engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
        engine.step()
    tiers = engine.memory_breakdown(by_tier=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"peak_rss": peak, "tiers": tiers}))


def peak_rss(preset: str, device: str, nvme_path: str) -> dict:
    environment = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(SCRIPT), "--rss-worker", preset, device, nvme_path],
                          capture_output=True, text=True, check=True, env=environment)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nvme-path", type=Path, default=None, help="a directory on the disk to test (default: a temp dir)")
    parser.add_argument("--elements", type=int, default=50_000_000, help="fp32 elements in the optimizer step")
    parser.add_argument("--sub-group-size", type=int, default=10_000_000)
    parser.add_argument("--megabytes", type=int, default=1024, help="bytes paged through the swap file / dd")
    parser.add_argument("--preset", default="100m")
    parser.add_argument("--rss-worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rss_worker:
        rss_worker(*args.rss_worker)
        return
    torch.set_num_threads(os.cpu_count() or 1)
    with tempfile.TemporaryDirectory(dir=args.nvme_path) as directory:
        path = Path(directory)
        print(f"machine: {os.cpu_count()} cores, torch {torch.__version__}, load {os.getloadavg()[0]:.2f}; nvme path {path}")
        memory = memory_bandwidth(args.elements)
        optimizer, seconds = optimizer_bandwidth(args.elements, args.sub_group_size)
        print(f"| CPU optimizer step (fused AdamW, {args.elements:,} fp32 elements) | {seconds:.3f} s | "
              f"{optimizer / GB:.1f} GB/s | memory copy {memory / GB:.1f} GB/s | {optimizer / memory:.0%} |")
        deepspeed = deepspeed_bandwidth(args.elements, args.sub_group_size)
        if deepspeed is not None:
            print(f"| DeepSpeedCPUAdam step (same elements) | {deepspeed[1]:.3f} s | {deepspeed[0] / GB:.1f} GB/s | "
                  f"memory copy {memory / GB:.1f} GB/s | {deepspeed[0] / memory:.0%} |")
        dd_write, dd_read = dd_bandwidth(path, args.megabytes)
        swap_write, swap_read = swap_bandwidth(path, args.megabytes, args.sub_group_size // 4)
        print(f"| NVMe write (swap file vs dd oflag=direct) | {swap_write / GB:.2f} GB/s | {dd_write / GB:.2f} GB/s | "
              f"{swap_write / dd_write:.0%} |")
        print(f"| NVMe read (swap file vs dd iflag=direct) | {swap_read / GB:.2f} GB/s | {dd_read / GB:.2f} GB/s | "
              f"{swap_read / dd_read:.0%} |")
        in_memory = peak_rss(args.preset, "none", str(path))
        on_nvme = peak_rss(args.preset, "nvme", str(path))
        moved = on_nvme["tiers"]["nvme"]["optimizer_states"] - on_nvme["tiers"]["nvme"].get("params", 0)
        saved = in_memory["peak_rss"] - on_nvme["peak_rss"]
        print(f"| peak RSS, GPT {args.preset}, stage 2, 1 rank | in memory {in_memory['peak_rss'] / 2**20:,.0f} MiB | "
              f"optimizer on NVMe {on_nvme['peak_rss'] / 2**20:,.0f} MiB | saved {saved / 2**20:,.0f} MiB = "
              f"{saved / in_memory['tiers']['device']['optimizer_states']:.0%} of the optimizer state in memory "
              f"({in_memory['tiers']['device']['optimizer_states'] / 2**20:,.0f} MiB; {moved / 2**20:,.0f} MiB on NVMe) |")


if __name__ == "__main__":
    main()
