"""Expert parallelism: shardwise's `MoE(ep_size=P)` beside DeepSpeed's own (issue 29, C29).

    .venv/bin/python benchmarks/moe_expert_parallel.py --deepspeed-python /tmp/dsvenv/bin/python

One MoE layer alone, P = 2 ranks of one expert group, CPU/gloo, fp32: E experts (each a
Linear -> GELU -> Linear MLP), top-1 gating without random token selection (so both sides
route alike), capacity factor 1 (tokens over capacity dropped). Every rank builds the same
every-expert layer from one seed and keeps its E/P experts; both sides run forward +
backward of a sum of the output on the same tokens, in one torchrun job under the
interpreter of a DeepSpeed install (shardwise is imported from this checkout), one after
the other. Outputs and input gradients are compared. Printed: median step time per side
(the slowest rank's), tokens per second over the group, the ratio, the all-to-all bytes
shardwise counts per step and per rank, and `moe_all_to_all_bytes` for the same buffer.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

import torch
from torch import nn

from beside_deepspeed import launch_and_summarize, time_both_and_write


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per rank per step")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=1024, help="each expert's inner width")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--world", type=int, default=2, help="ranks, all in one expert group (ep_size)")
    parser.add_argument("--deepspeed-python", default=os.environ.get("DEEPSPEED_PYTHON", "/tmp/ds-venv/bin/python"))
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args()


def expert(args: argparse.Namespace) -> nn.Module:
    return nn.Sequential(nn.Linear(args.hidden, args.ffn), nn.GELU(), nn.Linear(args.ffn, args.hidden))


def moe_arguments(args: argparse.Namespace) -> dict:
    return {"num_experts": args.experts, "ep_size": args.world, "k": 1, "capacity_factor": 1.0,
            "min_capacity": 0, "use_rts": False}


def own_experts(layer: nn.Module, whole: dict[str, torch.Tensor], rank: int, local: int) -> None:
    """Load the every-expert layer's gate and this rank's experts (rank·local ..) into `layer`."""
    mine = {}
    for name, value in whole.items():
        if ".deepspeed_experts." not in name:
            mine[name] = value
            continue
        head, tail = name.split(".deepspeed_experts.")
        index, rest = tail.split(".", 1)
        if rank * local <= int(index) < (rank + 1) * local:
            mine[f"{head}.deepspeed_experts.{int(index) - rank * local}.{rest}"] = value
    layer.load_state_dict(mine, strict=True)


def worker(args: argparse.Namespace) -> None:
    import deepspeed
    import torch.distributed as dist
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    from shardwise.frontends.deepspeed.api.moe.layer import MoE
    from shardwise.runtime.distributed.collectives import CommStats, Communicator
    from shardwise.runtime.distributed.mesh import ParallelMesh, ParallelSizes
    from shardwise.runtime.distributed.setup import collective_timeout

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    arguments = moe_arguments(args)
    torch.manual_seed(0)
    whole = MoE(args.hidden, expert(args), **{**arguments, "ep_size": 1}).state_dict()
    local = args.experts // world
    tokens = torch.randn(args.tokens, args.hidden, generator=torch.Generator().manual_seed(rank))

    stats = CommStats()
    mesh = ParallelMesh(ParallelSizes(data_shard=world), rank, torch.device("cpu"), collective_timeout())
    ours = MoE(args.hidden, expert(args), **arguments)
    own_experts(ours, whole, rank, local)
    ours.use_expert_groups(Communicator(mesh.expert_handles(world)[0], stats))
    theirs = DeepSpeedMoE(args.hidden, expert(args), **arguments)
    theirs.set_deepspeed_parallelism()
    own_experts(theirs, whole, rank, local)

    def step_of(layer: nn.Module):
        def step() -> list[torch.Tensor]:
            x = tokens.clone().requires_grad_()
            out, _, _ = layer(x)
            out.sum().backward()
            layer.zero_grad(set_to_none=True)
            return [out.detach(), x.grad]
        return step

    time_both_and_write(step_of(ours), step_of(theirs), stats, rank, args)


def main() -> None:
    args = parse_args()
    if args.worker is not None:
        worker(args)
        return
    from shardwise.formulas.communication import moe_all_to_all_bytes

    summary = launch_and_summarize(__file__, args, port=29536, environment={"DS_ACCELERATOR": "cpu"})
    for side in ("shardwise", "deepspeed"):
        summary[f"{side}_tokens_per_s"] = round(args.tokens * args.world / summary[f"{side}_step_s"])
    capacity = math.ceil(args.tokens / args.experts * 1.0)  # top-1, capacity factor 1
    summary["formula_all_to_all_bytes"] = moe_all_to_all_bytes(
        experts=args.experts, capacity=capacity, width=args.hidden, bytes_per_element=4, ep_size=args.world)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
