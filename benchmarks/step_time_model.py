"""The time model (`shardwise estimate`'s step time) against measured step times (issue 27 item 3a).

    .venv/bin/python benchmarks/step_time_model.py                    # 2 gloo ranks, GPT 25m
    .venv/bin/python benchmarks/step_time_model.py --world-size 4     # adds hybrid sharding (S=2, R=2)

In one run: first `shardwise estimate --measure`'s probe measures this machine (peak
FLOP/s, MFU on 2 layers of the preset's width, the update's bandwidth, the loopback link),
then every plan trains the whole GPT preset on fresh rank processes, and
its median step time (the slowest rank's, after warm-up) is printed beside the
prediction, with the error and the load average when the plan started. The machine is
shared, so compare within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

SCRIPT = Path(__file__).resolve()
sys.path.insert(0, str(SCRIPT.parent))

from launch import run_ranks  # noqa: E402

# name: (config overrides, accumulation, world sizes it runs at)
PLANS: dict[str, dict[str, Any]] = {
    "stage0": {"zero_optimization": {"stage": 0}},
    "stage1": {"zero_optimization": {"stage": 1}},
    "stage2": {"zero_optimization": {"stage": 2}},
    "stage3": {"zero_optimization": {"stage": 3}},
    "stage2+cpu-offload": {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
    "stage2+full-recompute": {"zero_optimization": {"stage": 2}, "activation_checkpointing": {"policy": "full"}},
    "tp2+stage1": {"zero_optimization": {"stage": 1}, "tensor_parallel": {"size": 2}},
    "pp2+stage1 (m=4)": {"zero_optimization": {"stage": 1}, "gradient_accumulation_steps": 4,
                         "pipeline_parallel": {"size": 2, "schedule": "1f1b"}},
    "hybrid stage3 (S=2, R=2)": {"zero_optimization": {"stage": 3, "mics_shard_size": 2}},
}
FOUR_RANKS_ONLY = {"hybrid stage3 (S=2, R=2)"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="25m")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--plans", default="", help="comma-separated subset of: " + ", ".join(PLANS))
    parser.add_argument("--profile", type=Path, help="reuse this speed profile instead of measuring now")
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def selected_plans(listed: str) -> list[str]:
    """The plans `--plans` names, in PLANS' order. Names hold commas ("hybrid stage3 (S=2,
    R=2)"), so they are found by name, longest first, not by splitting at commas."""
    if not listed:
        return list(PLANS)
    chosen, rest = set(), listed
    for name in sorted(PLANS, key=len, reverse=True):
        if name in rest:
            chosen.add(name)
            rest = rest.replace(name, "")
    if rest.strip(", "):
        raise SystemExit(f"--plans: unknown plan in {listed!r} (left over: {rest.strip(', ')!r}); choose from: "
                         + "; ".join(PLANS))
    return [name for name in PLANS if name in chosen]


def plan_config(name: str, args: argparse.Namespace) -> dict[str, Any]:
    config = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
              "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}}}
    config.update(json.loads(json.dumps(PLANS[name])))
    return config


# -- inside a rank -------------------------------------------------------------------------
def next_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))


def worker(args: argparse.Namespace) -> None:
    import shardwise
    from workload import ByteBatches, build_gpt, init_process_group, write_result

    from shardwise.models import GPTConfig
    from shardwise.tools.planner.measure import ProbeShape, compute_rates

    rank, world = init_process_group()
    gpt = GPTConfig.preset(args.preset)
    peak, achieved = compute_rates(ProbeShape(gpt.n_embd, gpt.n_head, args.seq_len, args.micro_batch,
                                              gpt.vocab_size, gpt.n_layer), repeats=3)
    config = plan_config(args.worker, args)
    engine = shardwise.initialize(build_gpt(args.preset, 1234), config)
    accumulation = config["gradient_accumulation_steps"]
    batches = ByteBatches(1234, world, args.micro_batch, args.seq_len)
    data_rank = getattr(engine.mesh, "data_rank", rank) if hasattr(engine, "mesh") else rank
    times = []
    for step in range(args.warmup + args.steps):
        parts = [batches.batch(step * accumulation + i, data_rank) for i in range(accumulation)]
        torch.distributed.barrier()
        started = time.perf_counter()
        if "pipeline_parallel" in config:
            engine.train_batch(iter(parts), loss_fn=next_token_loss)
        else:
            for inputs, targets in parts:
                loss = engine(inputs, targets)
                engine.backward(loss)
                engine.step()
        if step >= args.warmup:
            times.append(time.perf_counter() - started)
    write_result(rank, {"seconds": times, "peak": peak, "achieved": achieved})
    engine.destroy() if hasattr(engine, "destroy") else None
    torch.distributed.destroy_process_group()


# -- the parent ----------------------------------------------------------------------------
def predicted_seconds(name: str, args: argparse.Namespace, speeds: Any) -> float:
    """The model's step time for plan `name` on `speeds`."""
    from shardwise.formulas.memory import NO_OFFLOAD, Offload
    from shardwise.formulas.model_shape import ModelShape
    from shardwise.formulas.parallel_activation import ModelParallel
    from shardwise.models import GPTConfig
    from shardwise.tools.planner.timing import Plan, predict
    from workload import build_gpt

    config = plan_config(name, args)
    zero = config["zero_optimization"]
    gpt = GPTConfig.preset(args.preset)
    params = sum(p.numel() for p in build_gpt(args.preset, 1234).parameters())
    shape = ModelShape(args.preset, params, gpt.n_embd, gpt.n_layer, gpt.n_head, gpt.vocab_size)
    offload = Offload("cpu") if "offload_optimizer" in zero else NO_OFFLOAD
    parallel = ModelParallel(tensor=config.get("tensor_parallel", {}).get("size", 1),
                             pipeline=config.get("pipeline_parallel", {}).get("size", 1))
    plan = Plan(zero["stage"], offload, config.get("activation_checkpointing", {}).get("policy", "none"), parallel,
                args.micro_batch, config["gradient_accumulation_steps"], zero.get("mics_shard_size"))
    prediction = predict(shape, plan, speeds, num_gpus=args.world_size, gpus_per_node=args.world_size,
                         seq_len=args.seq_len, dtype="fp32", optimizer_state_bytes=8)
    return prediction.step_s


def main(args: argparse.Namespace) -> None:
    from shardwise.tools.planner.devices import load_profile
    from shardwise.models import GPTConfig
    from shardwise.tools.planner.measure import ProbeShape, measure

    names = [n for n in selected_plans(args.plans) if args.world_size == 4 or n not in FOUR_RANKS_ONLY]
    load = os.getloadavg()[0]
    gpt = GPTConfig.preset(args.preset)
    probe = ProbeShape(gpt.n_embd, gpt.n_head, args.seq_len, args.micro_batch, gpt.vocab_size)
    speeds = load_profile(args.profile) if args.profile else measure("/tmp/shardwise-speeds.json",
                                                                    ranks=args.world_size, probe=probe)
    print(f"speeds (load {load:.2f} at the probe): {speeds}", flush=True)
    rows = []
    for name in names:
        load = os.getloadavg()[0]
        argv = ["--worker", name, "--preset", args.preset, "--micro-batch", str(args.micro_batch),
                "--seq-len", str(args.seq_len), "--warmup", str(args.warmup), "--steps", str(args.steps)]
        results = run_ranks(SCRIPT, argv, args.world_size, 900)
        slowest = [max(step) for step in zip(*(r["seconds"] for r in results))]
        measured = statistics.median(slowest)
        predicted = predicted_seconds(name, args, speeds)
        # the whole model's forward and backward, no engine, run by the plan's own ranks just
        # before it: the compute rate of that moment (the machine is shared)
        achieved = min(r["achieved"] for r in results)
        peak = max(speeds.peak_flops, achieved)
        beside = predicted_seconds(name, args, replace(speeds, peak_flops=peak, mfu=achieved / peak))
        rows.append({"plan": name, "measured_s": measured, "predicted_s": predicted, "error": predicted / measured - 1,
                     "predicted_beside_s": beside, "error_beside": beside / measured - 1, "load": load})
        print(f"{name:28s} measured {measured:.3f} s  predicted {predicted:.3f} s ({100 * (predicted / measured - 1):+.1f}%)"
              f"  with the compute probed beside it {beside:.3f} s ({100 * (beside / measured - 1):+.1f}%)"
              f"  (load {load:.2f})", flush=True)
    print()
    print("| plan | measured s/step | predicted (profile) | error | predicted (compute probed beside) | error | load |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['plan']} | {row['measured_s']:.3f} | {row['predicted_s']:.3f} | {100 * row['error']:+.1f}% | "
              f"{row['predicted_beside_s']:.3f} | {100 * row['error_beside']:+.1f}% | {row['load']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    arguments = parse_args()
    worker(arguments) if arguments.worker else main(arguments)
