"""Ulysses attention: shardwise's sequence <-> head all-to-alls beside DeepSpeed's
`DistributedAttention` (issue 10, C14).

    .venv/bin/python benchmarks/ulysses_attention.py --deepspeed-python /tmp/dsvenv/bin/python

The attention layer alone, S = 2 ranks of one sequence group, CPU/gloo: each rank holds
1/S of the positions of q, k and v ([batch, seq/S, heads, head_dim]); both sides exchange
them for 1/S of the heads over whole sequences, run the same causal
`scaled_dot_product_attention`, and exchange back; forward + backward of a sum of the
output, fp32. Both sides run in one torchrun job under the interpreter of a DeepSpeed
install (shardwise is imported from this checkout), one after the other on the same
inputs; outputs and input gradients are compared (they must be equal: both are exact).
Printed: median step time per side (the slowest rank's), the ratio, the bytes shardwise
counts per step, and the largest difference.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=2048, help="whole sequence (each rank holds 1/S)")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--deepspeed-python", default=os.environ.get("DEEPSPEED_PYTHON", "/tmp/ds-venv/bin/python"))
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args()


def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[batch, seq, heads, dim] in and out: the kernel both sides wrap."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    return out.transpose(1, 2)


def timed(step, args: argparse.Namespace) -> tuple[list[float], list[torch.Tensor]]:
    import torch.distributed as dist

    times, result = [], []
    for index in range(args.warmup + args.steps):
        dist.barrier()
        started = time.perf_counter()
        result = step()
        if index >= args.warmup:
            times.append(time.perf_counter() - started)
    return times, result


def worker(args: argparse.Namespace) -> None:
    import deepspeed
    import torch.distributed as dist
    from deepspeed.sequence.layer import DistributedAttention

    from shardwise.runtime.distributed.collectives import CommStats, Communicator
    from shardwise.runtime.distributed.mesh import ParallelMesh, ParallelSizes
    from shardwise.runtime.distributed.setup import collective_timeout
    from shardwise.runtime.parallel.sequence.all_to_all import heads_to_sequence, sequence_to_heads

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")  # DeepSpeed's comm layer, over torch's default group
    rank, world = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(rank)
    shape = (args.batch, args.seq_len // world, args.heads, args.head_dim)
    inputs = [torch.randn(shape, generator=generator) for _ in range(3)]

    stats = CommStats()
    mesh = ParallelMesh(ParallelSizes(sequence=world), rank, torch.device("cpu"), collective_timeout())
    comm = Communicator(mesh["sequence"], stats)

    def shardwise_step() -> list[torch.Tensor]:
        q, k, v = (t.clone().requires_grad_() for t in inputs)
        whole = [sequence_to_heads(t, comm) for t in (q, k, v)]
        out = heads_to_sequence(local_attention(*whole), comm)
        out.sum().backward()
        return [out.detach(), q.grad, k.grad, v.grad]

    attention = DistributedAttention(local_attention, mesh["sequence"].group, scatter_idx=2, gather_idx=1)

    def deepspeed_step() -> list[torch.Tensor]:
        q, k, v = (t.clone().requires_grad_() for t in inputs)
        out = attention(q, k, v, 0)  # batch_dim_idx: the batch is dimension 0
        out.sum().backward()
        return [out.detach(), q.grad, k.grad, v.grad]

    ours, ours_result = timed(shardwise_step, args)
    steps = args.warmup + args.steps
    shardwise_bytes = {key: value // steps for key, value in stats.totals().items()}
    theirs, theirs_result = timed(deepspeed_step, args)
    difference = max((a - b).abs().max().item() for a, b in zip(ours_result, theirs_result))
    result = {"shardwise": ours, "deepspeed": theirs, "difference": difference, "shardwise_bytes": shardwise_bytes}
    (args.worker / f"{rank}.json").write_text(json.dumps(result))


def main() -> None:
    args = parse_args()
    if args.worker is not None:
        worker(args)
        return
    if not Path(args.deepspeed_python).exists():
        sys.exit(f"no DeepSpeed interpreter at {args.deepspeed_python}: see benchmarks/zero3_vs_fsdp2_deepspeed.py "
                 "for the install commands, or pass --deepspeed-python")
    with tempfile.TemporaryDirectory(prefix="ulysses-") as directory:
        argv = [f"--{name.replace('_', '-')}={value}" for name, value in vars(args).items()
                if name not in ("deepspeed_python", "worker")]
        command = [args.deepspeed_python, "-m", "torch.distributed.run", f"--nproc_per_node={args.world}",
                   "--master_port=29534", str(Path(__file__).resolve()), *argv, "--worker", directory]
        environment = os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parent.parent), "OMP_NUM_THREADS": "1"}
        done = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            sys.exit(f"the torchrun job failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
        results = [json.loads((Path(directory) / f"{rank}.json").read_text()) for rank in range(args.world)]
    summary = {}
    for side in ("shardwise", "deepspeed"):
        per_step = [max(result[side][i] for result in results) for i in range(args.steps)]
        summary[f"{side}_step_s"] = round(statistics.median(per_step), 4)
    summary["shardwise_over_deepspeed"] = round(summary["shardwise_step_s"] / summary["deepspeed_step_s"], 3)
    summary["max_abs_difference"] = max(result["difference"] for result in results)
    summary["shardwise_bytes_per_step_rank0"] = results[0]["shardwise_bytes"]
    summary["load_average_1min"] = round(os.getloadavg()[0], 2)
    summary["args"] = {key: value for key, value in vars(args).items() if key != "worker"}
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
