"""shardwise ZeRO stages 0, 1 and 2 beside torch DistributedDataParallel (issue 2, C1-C3).

    .venv/bin/python benchmarks/zero_vs_ddp.py                # ≈25M GPT, 2 ranks, CPU/gloo

The parent starts every variant on fresh rank processes (so peak RSS is that variant's
own), one variant after the other, all on the same model, initial weights, batches and
seed, in fp32 so that losses can be compared to ~1e-5. Settings are matched: DDP's
default 25 MiB buckets against shardwise buckets of the same size in elements with
overlap_comm on; torch's fused AdamW and clipping at the same global norm on both sides.

Targets: stage 0 ≤ 1.05× DDP's step time, stages 1 and 2 ≤ 1.10×; stage 1/2 peak RSS
below DDP's by at least the optimizer state they no longer hold.
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
from report import (  # noqa: E402
    VariantSummary,
    comm_text,
    loss_difference,
    machine_line,
    markdown_table,
    mib,
    verdict,
)

VARIANTS = ("ddp", "stage0", "stage1", "stage2")
DDP_BUCKET_MIB = 25  # torch's default bucket_cap_mb
BUCKET_ELEMENTS = DDP_BUCKET_MIB * 1024 * 1024 // 4  # the same bytes in fp32 elements
STEP_TIME_TARGETS = {"stage0": 1.05, "stage1": 1.10, "stage2": 1.10}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="25m", help="GPTConfig preset (default: 25m)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=2, help="sequences per rank per step")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--steps", type=int, default=8, help="timed steps (median reported)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="repeat the whole set of variants; a variant's step time is its "
                        "median over rounds (interleaving evens out a machine whose load drifts)")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--clip", type=float, default=1.0, help="gradient clipping norm, both sides")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--reduce-scatter", action=argparse.BooleanOptionalAction, default=True,
                        help="shardwise zero_optimization.reduce_scatter; --no-reduce-scatter all-reduces "
                        "gradient buckets in place (gloo runs a reduce-scatter as clone + all-reduce)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per variant")
    parser.add_argument("--json", type=Path, help="also write the raw per-rank results here")
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# -- inside a rank -------------------------------------------------------------------------
def adamw_hyperparameters(args: argparse.Namespace) -> dict[str, Any]:
    return {"lr": args.lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}


def shardwise_config(stage: int, args: argparse.Namespace) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": args.clip,
        "optimizer": {"type": "AdamW", "params": adamw_hyperparameters(args)},
        "zero_optimization": {
            "stage": stage,
            "overlap_comm": True,
            "reduce_scatter": args.reduce_scatter,
            "reduce_bucket_size": BUCKET_ELEMENTS,
            "allgather_bucket_size": BUCKET_ELEMENTS,
        },
    }


def train_ddp(args: argparse.Namespace, rank: int, world_size: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    from workload import ByteBatches, TorchLoopStep, build_gpt, local_bytes, optimizer_state_bytes, rss_bytes, timed_steps

    baseline = rss_bytes()
    model = build_gpt(args.preset, args.seed)
    ddp = DistributedDataParallel(model, bucket_cap_mb=DDP_BUCKET_MIB)
    optimizer = torch.optim.AdamW(model.parameters(), fused=True, **adamw_hyperparameters(args))
    train_step = TorchLoopStep(ddp, model, optimizer, args.clip)
    batches = ByteBatches(args.seed, world_size, args.micro_batch, args.seq_len)
    record = timed_steps(train_step, batches, rank, args.warmup, args.steps)
    params = list(model.parameters())
    bucket_bytes = sum(int(size) for size in ddp._get_ddp_logging_data()["bucket_sizes"].split(","))
    return {
        "model_state": {
            "params": local_bytes(params),
            "grads": train_step.grad_bytes,
            "optimizer_states": optimizer_state_bytes(optimizer),
            "buffers": bucket_bytes,
        },
        # DDP counts nothing itself: every gradient is all-reduced once per step (ring model).
        "comm_per_step": {"all_reduce": 2 * local_bytes(params) * (world_size - 1) // world_size},
        "record": record,
        "baseline_rss": baseline,
    }


def train_shardwise(stage: int, args: argparse.Namespace, rank: int, world_size: int) -> dict[str, Any]:
    import shardwise

    from workload import ByteBatches, build_gpt, engine_step, rss_bytes, timed_steps

    baseline = rss_bytes()
    engine = shardwise.initialize(build_gpt(args.preset, args.seed), shardwise_config(stage, args))
    batches = ByteBatches(args.seed, world_size, args.micro_batch, args.seq_len)
    record = timed_steps(engine_step(engine), batches, rank, args.warmup, args.steps)
    total_steps = args.warmup + args.steps
    comm = {op: volume // total_steps for op, volume in engine.comm_volume().items() if volume}
    result = {
        "model_state": engine.memory_breakdown(),
        "comm_per_step": comm,
        "comm_wait_s_per_step": engine.comm.wait_seconds / total_steps,
        "record": record,
        "baseline_rss": baseline,
    }
    engine.destroy()
    return result


def worker(args: argparse.Namespace) -> None:
    from workload import init_process_group, rank_result, write_result

    rank, world_size = init_process_group()
    if args.worker == "ddp":
        measured = train_ddp(args, rank, world_size)
    else:
        measured = train_shardwise(int(args.worker[-1]), args, rank, world_size)
    record, baseline = measured.pop("record"), measured.pop("baseline_rss")
    write_result(rank, rank_result(args.worker, record, baseline, **measured))
    torch.distributed.destroy_process_group()


# -- the parent ----------------------------------------------------------------------------
def worker_argv(args: argparse.Namespace, variant: str) -> list[str]:
    keys = ("preset", "micro_batch", "seq_len", "warmup", "steps", "lr", "clip", "seed")
    argv = ["--worker", variant, "--reduce-scatter" if args.reduce_scatter else "--no-reduce-scatter"]
    for key in keys:
        argv += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    return argv


def print_report(args: argparse.Namespace, results: dict[str, VariantSummary]) -> None:
    ddp = results.get("ddp")
    print()
    print(machine_line())
    print(
        f"model: GPT preset {args.preset}, seq {args.seq_len}, micro-batch {args.micro_batch} per rank, "
        f"{args.world_size} ranks, fp32, AdamW (torch fused, both sides), clip {args.clip}; "
        f"{args.warmup} warm-up + {args.steps} timed steps x {args.rounds} round(s)"
    )
    print(
        f"settings: DDP bucket_cap_mb={DDP_BUCKET_MIB} (default); shardwise reduce_bucket_size = "
        f"allgather_bucket_size = {BUCKET_ELEMENTS:,} elements (= {DDP_BUCKET_MIB} MiB fp32), overlap_comm true, "
        f"reduce_scatter {str(args.reduce_scatter).lower()}"
    )
    print()
    rows = []
    for name, summary in results.items():
        ratio = f"{summary.step_s / ddp.step_s:.3f}" if ddp else "-"
        cpu_ratio = f"{summary.cpu_s / ddp.cpu_s:.3f}" if ddp else "-"
        state = summary.extra["model_state"]
        loss = "-"
        if ddp and name != "ddp":
            absolute, relative = loss_difference(summary.losses, ddp.losses)
            loss = f"{absolute:.1e} / {relative:.1e}"
        rows.append([
            name,
            f"{summary.step_s:.3f}",
            ratio,
            f"{summary.cpu_s:.3f}",
            cpu_ratio,
            " / ".join(mib(rss) for rss in summary.peak_rss),
            " / ".join(mib(rss - base) for rss, base in zip(summary.peak_rss, summary.baseline_rss)),
            " / ".join(mib(state[key]) for key in ("params", "grads", "optimizer_states", "buffers")),
            comm_text(summary.extra["comm_per_step"]),
            f"{summary.extra['comm_wait_s_per_step']:.3f}" if "comm_wait_s_per_step" in summary.extra else "-",
            loss,
            f"{summary.load_at_start:.2f}",
        ])
    print(markdown_table(
        ["variant", "step s (median)", "x DDP", "CPU s per step", "CPU x DDP", "peak RSS MiB (rank 0 / 1)",
         "peak RSS - baseline MiB", "model state MiB (params / grads / optim / buffers)",
         "comm MiB per step", "blocked on comm s per step", "loss diff vs DDP (max abs / rel)", "load"],
        rows,
    ))
    if ddp:
        print()
        print_targets(ddp, results)


def print_targets(ddp: VariantSummary, results: dict[str, VariantSummary]) -> None:
    ddp_optim = ddp.extra["model_state"]["optimizer_states"]
    for name, limit in STEP_TIME_TARGETS.items():
        if name in results:
            ratio = results[name].step_s / ddp.step_s
            print(f"target {name} step time <= {limit:.2f}x DDP: {ratio:.3f}x -> {verdict(ratio <= limit)}")
    for name in ("stage1", "stage2"):
        if name not in results:
            continue
        summary = results[name]
        required = ddp_optim - summary.extra["model_state"]["optimizer_states"]
        savings = [d - s for d, s in zip(ddp.peak_rss, summary.peak_rss)]
        met = min(savings) >= required
        print(
            f"target {name} peak RSS below DDP's by >= optimizer state not held ({mib(required)} MiB): "
            f"saves {' / '.join(mib(s) for s in savings)} MiB per rank -> {verdict(met)}"
        )
    print(f"load average at the end: {', '.join(f'{v:.2f}' for v in os.getloadavg())}")


def main() -> None:
    args = parse_args()
    compare_in_rounds(SCRIPT, args, worker=worker, worker_argv=worker_argv, world_size=args.world_size,
                      report=print_report)


if __name__ == "__main__":
    main()
