"""bf16 training over several micro-batches, gradients summed in bf16 or in fp32
(DeepSpeed's `data_types.grad_accum_dtype`), at ZeRO stages 1, 2 and 3.

    .venv/bin/python benchmarks/grad_accum_dtype.py            # ≈25M GPT, 2 ranks, CPU/gloo, 4 micro-batches

Each variant runs on fresh rank processes (benchmarks/launch.py), all on the same model,
initial weights and batches. A timed step is a whole accumulation window: 4 forwards and
backwards, then the optimizer step. The peer of each "-fp32" variant is the same stage
accumulating in bf16: the price of fp32 accumulation is its step time over the peer's
(stage 1 adds every micro-batch's bf16 gradient into an fp32 buffer and casts the buffer
for the reduce-scatter; stages 2-3 add each reduced chunk into an fp32 partition) and its
gradient bytes (4 per element instead of 2, docs/formulas.md#fp32-gradient-accumulation).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch

SCRIPT = Path(__file__).resolve()
sys.path.insert(0, str(SCRIPT.parent))

from launch import compare_in_rounds  # noqa: E402
from report import VariantSummary, loss_difference, machine_line, markdown_table, mib  # noqa: E402

VARIANTS = ("stage1-bf16", "stage1-fp32", "stage2-bf16", "stage2-fp32", "stage3-bf16", "stage3-fp32")
BUCKET_ELEMENTS = 25 * 1024 * 1024 // 2  # 25 MiB of bf16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="25m", help="GPTConfig preset (default: 25m)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=2, help="sequences per rank per micro-batch")
    parser.add_argument("--accumulation", type=int, default=4, help="micro-batches per optimizer step")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--steps", type=int, default=4, help="timed steps (median reported)")
    parser.add_argument("--rounds", type=int, default=1, help="repeat the whole set of variants, interleaved")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per variant")
    parser.add_argument("--json", type=Path, help="also write the raw per-rank results here")
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# -- inside a rank -------------------------------------------------------------------------
def shardwise_config(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    stage, accumulate = variant.split("-")
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.accumulation,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "zero_optimization": {"stage": int(stage[-1]), "overlap_comm": True, "reduce_bucket_size": BUCKET_ELEMENTS,
                              "allgather_bucket_size": BUCKET_ELEMENTS},
    }
    if accumulate == "fp32":
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    return config


class WindowBatches:
    """Step s is the accumulation window of micro-batches s·A .. s·A + A − 1."""

    def __init__(self, batches: Any, accumulation: int):
        self.batches, self.accumulation = batches, accumulation

    def batch(self, step: int, rank: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        pairs = [self.batches.batch(step * self.accumulation + micro, rank) for micro in range(self.accumulation)]
        return [inputs for inputs, _ in pairs], [targets for _, targets in pairs]


def train(variant: str, args: argparse.Namespace, rank: int, world_size: int) -> dict[str, Any]:
    import shardwise

    from workload import ByteBatches, build_gpt, rss_bytes, timed_steps

    baseline = rss_bytes()
    engine = shardwise.initialize(build_gpt(args.preset, args.seed), shardwise_config(variant, args))

    def window(inputs: list[torch.Tensor], targets: list[torch.Tensor]) -> torch.Tensor:
        total = torch.zeros(())
        for x, y in zip(inputs, targets):
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            total += loss.detach().float()
        return total / len(inputs)

    batches = WindowBatches(ByteBatches(args.seed, world_size, args.micro_batch, args.seq_len), args.accumulation)
    record = timed_steps(window, batches, rank, args.warmup, args.steps)
    result = {"model_state": engine.memory_breakdown(), "record": record, "baseline_rss": baseline}
    engine.destroy()
    return result


def worker(args: argparse.Namespace) -> None:
    from workload import init_process_group, rank_result, write_result

    rank, world_size = init_process_group()
    measured = train(args.worker, args, rank, world_size)
    record, baseline = measured.pop("record"), measured.pop("baseline_rss")
    write_result(rank, rank_result(args.worker, record, baseline, **measured))
    torch.distributed.destroy_process_group()


# -- the parent ----------------------------------------------------------------------------
def worker_argv(args: argparse.Namespace, variant: str) -> list[str]:
    keys = ("preset", "micro_batch", "accumulation", "seq_len", "warmup", "steps", "seed")
    argv = ["--worker", variant]
    for key in keys:
        argv += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    return argv


def print_report(args: argparse.Namespace, results: dict[str, VariantSummary]) -> None:
    print()
    print(machine_line())
    print(f"model: GPT preset {args.preset}, seq {args.seq_len}, micro-batch {args.micro_batch} per rank, "
          f"{args.accumulation} micro-batches per step, {args.world_size} ranks, bf16, AdamW, clip 1.0; "
          f"{args.warmup} warm-up + {args.steps} timed steps x {args.rounds} round(s)")
    print()
    rows = []
    for name, summary in results.items():
        peer = results.get(name.replace("-fp32", "-bf16")) if name.endswith("-fp32") else None
        state = summary.extra["model_state"]
        loss = "-"
        if peer is not None:
            absolute, relative = loss_difference(summary.losses, peer.losses)
            loss = f"{absolute:.1e} / {relative:.1e}"
        rows.append([
            name,
            f"{summary.step_s:.3f}",
            f"{summary.step_s / peer.step_s:.3f}" if peer else "-",
            f"{summary.cpu_s:.3f}",
            f"{summary.cpu_s / peer.cpu_s:.3f}" if peer else "-",
            mib(state["grads"]),
            " / ".join(mib(rss) for rss in summary.peak_rss),
            loss,
            f"{summary.load_at_start:.2f}",
        ])
    print(markdown_table(
        ["variant", "step s (median)", "x bf16 sum", "CPU s per step", "CPU x bf16 sum", "grads MiB",
         "peak RSS MiB (rank 0 / 1)", "loss diff vs bf16 sum (max abs / rel)", "load"],
        rows,
    ))
    print(f"load average at the end: {', '.join(f'{v:.2f}' for v in os.getloadavg())}")


def main() -> None:
    args = parse_args()
    compare_in_rounds(SCRIPT, args, worker=worker, worker_argv=worker_argv, world_size=args.world_size,
                      report=print_report)


if __name__ == "__main__":
    main()
