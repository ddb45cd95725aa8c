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
from pathlib import Path

import torch
import torch.nn.functional as F

from beside_deepspeed import launch_and_summarize, time_both_and_write


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

    time_both_and_write(shardwise_step, deepspeed_step, stats, rank, args)


def main() -> None:
    args = parse_args()
    if args.worker is not None:
        worker(args)
        return
    summary = launch_and_summarize(__file__, args, port=29534)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
