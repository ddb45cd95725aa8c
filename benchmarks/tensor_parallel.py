"""shardwise tensor parallelism beside torch's own DTensor tensor parallelism (issue 10, C13).

    .venv/bin/python benchmarks/tensor_parallel.py            # ≈20M Llama, TP=2 on 2 ranks, CPU/gloo

Both sides train the same Hugging Face Llama (untied embeddings, GQA), from the same
initial weights, on the same byte batches, with tensor parallelism of size 2 and no data
parallelism, in fp32 with AdamW:

    dtensor    torch.distributed.tensor.parallel.parallelize_module with the Llama plan
               torchtitan uses: q/k/v and gate/up ColwiseParallel, o/down RowwiseParallel,
               the embedding RowwiseParallel(input_layouts=Replicate()), the output layer
               ColwiseParallel(output_layouts=Shard(-1)) and the loss under loss_parallel()
    shardwise  shardwise.initialize with tensor_parallel.size 2 (its built-in Llama plan,
               vocabulary-parallel embedding and cross-entropy), ZeRO stage 0
    shardwise_sp   the same with Megatron sequence parallelism

The loss is F.cross_entropy on the output logits on both sides (sharded by vocabulary,
never gathered). No gradient clipping: torch's clip_grad_norm_ cannot mix the DTensor
and plain parameters a partly parallelized model has. Each variant runs on fresh rank
processes one after the other; step time is the slowest rank's, median over timed steps.
Target (issue 10): shardwise <= 1.0x DTensor's step time. The machine may be shared with
other jobs: the load average is printed with every variant.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

SCRIPT = Path(__file__).resolve()
sys.path.insert(0, str(SCRIPT.parent))

from launch import compare_in_rounds  # noqa: E402
from report import VariantSummary, comm_text, loss_difference, machine_line, markdown_table, mib, verdict  # noqa: E402

VARIANTS = ("dtensor", "shardwise", "shardwise_sp")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per step (both ranks read them)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# -- inside a rank -------------------------------------------------------------------------
def build_llama(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    config = LlamaConfig(
        vocab_size=256, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3 // 64 * 64 or 64,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq_len, tie_word_embeddings=False, attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


def adamw(args: argparse.Namespace) -> dict[str, Any]:
    return {"lr": args.lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}


def train_dtensor(args: argparse.Namespace, world_size: int, rank: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        loss_parallel,
        parallelize_module,
    )

    from workload import ByteBatches, local_bytes, optimizer_state_bytes, timed_steps

    mesh = init_device_mesh("cpu", (world_size,))
    model = build_llama(args)
    plan = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    for index in range(args.layers):
        prefix = f"model.layers.{index}"
        plan.update({f"{prefix}.self_attn.{name}": ColwiseParallel() for name in ("q_proj", "k_proj", "v_proj")})
        plan[f"{prefix}.self_attn.o_proj"] = RowwiseParallel()
        plan.update({f"{prefix}.mlp.{name}": ColwiseParallel() for name in ("gate_proj", "up_proj")})
        plan[f"{prefix}.mlp.down_proj"] = RowwiseParallel()
    parallelize_module(model, mesh, plan)
    # foreach cannot mix the DTensor and the plain (norm) parameters of a partly parallelized model
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False, **adamw(args))

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=inputs).logits
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach().full_tensor() if hasattr(loss, "full_tensor") else loss.detach()

    batches = ByteBatches(args.seed, 1, args.micro_batch, args.seq_len)
    record = timed_steps(step, _SameBatch(batches), rank, args.warmup, args.steps)
    state = {"params": local_bytes(model.parameters()), "optimizer_states": optimizer_state_bytes(optimizer)}
    return record, state, {}


class _SameBatch:
    """Both tensor ranks read the same sequences (no data parallelism)."""

    def __init__(self, batches):
        self.batches = batches

    def batch(self, step: int, rank: int):
        return self.batches.batch(step, 0)


def train_shardwise(args: argparse.Namespace, world_size: int, rank: int, sequence_parallel: bool):
    import shardwise

    from workload import ByteBatches, timed_steps

    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": adamw(args)},
        "zero_optimization": {"stage": 0},
        "tensor_parallel": {"size": world_size, "sequence_parallel": sequence_parallel},
    }
    engine = shardwise.initialize(build_llama(args), config)

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = engine(input_ids=inputs).logits
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        engine.backward(loss)
        engine.step()
        return loss.detach()

    batches = ByteBatches(args.seed, 1, args.micro_batch, args.seq_len)
    record = timed_steps(step, _SameBatch(batches), rank, args.warmup, args.steps)
    total = args.warmup + args.steps
    comm = {op: volume // total for op, volume in engine.comm_volume(per_group=True).get("tensor", {}).items()}
    state = engine.memory_breakdown()
    engine.destroy()
    return record, state, {"comm_per_step": comm}


def worker(args: argparse.Namespace) -> None:
    from workload import init_process_group, rank_result, rss_bytes, write_result

    rank, world_size = init_process_group()
    baseline = rss_bytes()
    if args.worker == "dtensor":
        record, state, extra = train_dtensor(args, world_size, rank)
    else:
        record, state, extra = train_shardwise(args, world_size, rank, args.worker == "shardwise_sp")
    write_result(rank, rank_result(args.worker, record, baseline, model_state=state, **extra))
    torch.distributed.destroy_process_group()


# -- the parent ----------------------------------------------------------------------------
def worker_argv(args: argparse.Namespace, variant: str) -> list[str]:
    keys = ("hidden", "layers", "heads", "kv_heads", "micro_batch", "seq_len", "warmup", "steps", "lr", "seed")
    argv = ["--worker", variant]
    for key in keys:
        argv += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    return argv


def print_report(args: argparse.Namespace, results: dict[str, VariantSummary]) -> None:
    peer = results.get("dtensor")
    print()
    print(machine_line())
    print(f"model: Hugging Face Llama, hidden {args.hidden}, {args.layers} layers, {args.heads} heads / "
          f"{args.kv_heads} KV heads, vocabulary 256, seq {args.seq_len}, {args.micro_batch} sequences per step; "
          f"TP=2 on 2 ranks, fp32, AdamW, no clipping; {args.warmup} warm-up + {args.steps} timed steps x "
          f"{args.rounds} round(s)")
    print()
    rows = []
    tokens = args.micro_batch * args.seq_len
    for name, summary in results.items():
        loss = "-"
        if peer and name != "dtensor":
            absolute, relative = loss_difference(summary.losses, peer.losses)
            loss = f"{absolute:.1e} / {relative:.1e}"
        rows.append([
            name, f"{summary.step_s:.3f}", f"{tokens / summary.step_s:,.0f}",
            f"{summary.step_s / peer.step_s:.3f}" if peer else "-",
            " / ".join(mib(rss) for rss in summary.peak_rss),
            " / ".join(mib(r - b) for r, b in zip(summary.peak_rss, summary.baseline_rss)),
            f"{max(summary.peak_rss) / max(peer.peak_rss):.3f}" if peer else "-",
            comm_text(summary.extra.get("comm_per_step", {})) if summary.extra.get("comm_per_step") else "-",
            loss, f"{summary.load_at_start:.2f}",
        ])
    print(markdown_table(
        ["variant", "step s (median)", "tokens/s", "step x DTensor", "peak RSS MiB (rank 0 / 1)",
         "peak RSS - baseline MiB", "peak RSS x DTensor", "tensor-group comm MiB per step",
         "loss diff vs DTensor (max abs / rel)", "load"], rows))
    if peer:
        print()
        for name in ("shardwise", "shardwise_sp"):
            if name in results:
                ratio = results[name].step_s / peer.step_s
                print(f"target {name} step time <= 1.00x DTensor TP: {ratio:.3f}x -> {verdict(ratio <= 1.0)}")
    print(f"load average at the end: {', '.join(f'{v:.2f}' for v in os.getloadavg())}")


def main() -> None:
    args = parse_args()
    compare_in_rounds(SCRIPT, args, worker=worker, worker_argv=worker_argv, world_size=2,
                      report=print_report)


if __name__ == "__main__":
    main()
