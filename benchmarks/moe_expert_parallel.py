"""Expert parallelism: shardwise's `MoE(ep_size=P)` beside DeepSpeed's own (issue 29, C29).

    .venv/bin/python benchmarks/moe_expert_parallel.py --deepspeed-python /tmp/dsvenv/bin/python
    .venv/bin/python benchmarks/moe_expert_parallel.py --model gpt --deepspeed-python /tmp/dsvenv/bin/python

`--model layer` (the default): one MoE layer alone, P = 2 ranks of one expert group, CPU/gloo, fp32: E experts (each a
Linear -> GELU -> Linear MLP), top-1 gating without random token selection (so both sides
route alike), capacity factor 1 (tokens over capacity dropped). Every rank builds the same
every-expert layer from one seed and keeps its E/P experts; both sides run forward +
backward of a sum of the output on the same tokens, in one torchrun job under the
interpreter of a DeepSpeed install (shardwise is imported from this checkout), one after
the other. Outputs and input gradients are compared. Printed: median step time per side
(the slowest rank's), tokens per second over the group, the ratio, the all-to-all bytes
shardwise counts per step and per rank, and `moe_all_to_all_bytes` for the same buffer.

`--model gpt`: shardwise's GPT (models/gpt/model.py) with every second block's MLP a
mixture of E MLP experts at moe_ep_size P, in two forms built from one seed: its own MoE
blocks (the runtime's layer, each rank keeping its E/P experts as parallelize does), and
the same GPT with each MoE block's MLP replaced by DeepSpeed's `MoE(ep_size=P)` holding
the same gate and experts. A step is forward + backward of the cross-entropy of a batch
of sequences (the load-balancing loss left out on both sides); the logits and the token
embedding's gradient are compared, and the formula counts every MoE block's exchanges.
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
    parser.add_argument("--model", choices=("layer", "gpt"), default="layer")
    parser.add_argument("--layers", type=int, default=4, help="GPT blocks (every second one MoE), --model gpt")
    parser.add_argument("--seq-len", type=int, default=256, help="GPT sequence length (--tokens per rank), --model gpt")
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

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    (gpt_worker if args.model == "gpt" else layer_worker)(args, dist.get_rank(), dist.get_world_size())


def expert_group(world: int, rank: int, stats):
    from shardwise.runtime.distributed.collectives import Communicator
    from shardwise.runtime.distributed.mesh import ParallelMesh, ParallelSizes
    from shardwise.runtime.distributed.setup import collective_timeout

    mesh = ParallelMesh(ParallelSizes(data_shard=world), rank, torch.device("cpu"), collective_timeout())
    return Communicator(mesh.expert_handles(world)[0], stats)


def layer_worker(args: argparse.Namespace, rank: int, world: int) -> None:
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    from shardwise.frontends.deepspeed.api.moe.layer import MoE
    from shardwise.runtime.distributed.collectives import CommStats

    arguments = moe_arguments(args)
    torch.manual_seed(0)
    whole = MoE(args.hidden, expert(args), **{**arguments, "ep_size": 1}).state_dict()
    local = args.experts // world
    tokens = torch.randn(args.tokens, args.hidden, generator=torch.Generator().manual_seed(rank))

    stats = CommStats()
    ours = MoE(args.hidden, expert(args), **arguments)
    own_experts(ours, whole, rank, local)
    ours.use_expert_groups(expert_group(world, rank, stats))
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


def gpt_config(args: argparse.Namespace):
    from shardwise.models import GPTConfig

    return GPTConfig(vocab_size=256, block_size=args.seq_len, n_layer=args.layers, n_head=4, n_embd=args.hidden,
                     moe_experts=args.experts, moe_every=2, moe_capacity_factor=1.0, moe_min_capacity=0,
                     moe_ep_size=args.world)


class DeepSpeedBlockMLP(nn.Module):
    """DeepSpeed's MoE in a GPT block's place of the MLP: its output only."""

    def __init__(self, moe: nn.Module):
        super().__init__()
        self.moe = moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(x)[0]


def gpt_worker(args: argparse.Namespace, rank: int, world: int) -> None:
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    from shardwise.models import GPT
    from shardwise.models.gpt.model import MLP
    from shardwise.runtime.distributed.collectives import CommStats
    from shardwise.runtime.parallel.expert import MixtureOfExperts

    config = gpt_config(args)
    torch.manual_seed(0)
    ours = GPT(config)
    theirs = GPT(config)
    theirs.load_state_dict(ours.state_dict())
    stats = CommStats()
    group = expert_group(world, rank, stats)
    for mine, other in zip(ours.blocks, theirs.blocks):
        if not isinstance(mine.mlp, MixtureOfExperts):
            continue
        every = [expert.state_dict() for expert in mine.mlp.experts.local]
        mine.mlp.keep_experts_of(group.rank)  # as parallelize's expert step does
        mine.mlp.use_expert_groups(group)
        moe = DeepSpeedMoE(config.n_embd, MLP(config), num_experts=args.experts, ep_size=world, k=1,
                           capacity_factor=1.0, eval_capacity_factor=1.0, min_capacity=0, use_rts=False)
        moe.set_deepspeed_parallelism()
        moe.deepspeed_moe.gate.wg.load_state_dict(mine.mlp.gate.wg.state_dict())
        local = args.experts // world
        for index, expert_module in enumerate(moe.deepspeed_moe.experts.deepspeed_experts):
            expert_module.load_state_dict(every[group.rank * local + index])
        other.mlp = DeepSpeedBlockMLP(moe)
    rows = args.tokens // args.seq_len
    data = torch.randint(0, 256, (rows, args.seq_len + 1), generator=torch.Generator().manual_seed(rank))
    idx, targets = data[:, :-1], data[:, 1:]

    def step_of(model: nn.Module):
        def step() -> list[torch.Tensor]:
            logits = model(idx)
            nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1)).backward()
            grad = model.wte.weight.grad.clone()
            model.zero_grad(set_to_none=True)
            return [logits.detach(), grad]
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
    layers = args.layers // 2 if args.model == "gpt" else 1  # every second GPT block is MoE
    summary["formula_all_to_all_bytes"] = moe_all_to_all_bytes(
        experts=args.experts, capacity=capacity, width=args.hidden, bytes_per_element=4, ep_size=args.world,
        layers=layers)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
