"""ZenFlow beside plain ZeRO-Offload and no offload (issue 28, C30).

    .venv/bin/python benchmarks/zenflow_offload.py [--preset 10m] [--steps 40] [--topk 0.1] [--update-interval 4]
        [--stage 3]

One process, one thread, the same GPT, data (windows of the standard library's sources)
and seed in each variant, ZeRO stage 2 (`--stage 3`: stage 3, DeepSpeed's default
persistence threshold), fp32, AdamW:

- none     optimizer on the device (here: the same CPU), every step a full AdamW;
- offload  offload_optimizer cpu: the full AdamW on the host every step (C11);
- zenflow  offload_optimizer cpu + zenflow: a selective AdamW on the top `--topk` columns
           every step, the full AdamW on the host every `--update-interval` steps;
- zenflow-overlap  the same with `overlap_step`: the host's AdamW on a background thread
           while the next steps compute, its result applied one update later.

It prints the median step time of each variant (ZenFlow's split into its steps with and
without the CPU update), the ratio to the no-offload step, the bytes moved between device
and host per step against `zenflow_transfer_bytes` / `offload_transfer_bytes`, and the loss
averaged over the last quarter of the run (convergence beside synchronous offload).
On a CPU-only machine "device" and "host" are the same memory and the same cores: with
one compute thread (set here) the overlap's AdamW thread gets another core if one is free.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload import ByteBatches, build_gpt  # noqa: E402

import shardwise  # noqa: E402
from shardwise.formulas.communication import (  # noqa: E402
    offload_transfer_bytes,
    zenflow_selected_elements,
    zenflow_transfer_bytes,
)

SEED = 1234


def config(variant: str, args: argparse.Namespace) -> dict:
    zero: dict = {"stage": args.stage}
    if variant != "none":
        zero["offload_optimizer"] = {"device": "cpu"}
    if variant.startswith("zenflow"):
        zero["zenflow"] = {"topk_ratio": args.topk, "select_strategy": "step", "select_interval": args.select_interval,
                           "update_interval": args.update_interval, "full_warm_up_rounds": 0,
                           "overlap_step": variant == "zenflow-overlap"}
    return {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "eps": 1e-8, "weight_decay": 0.01}},
            "zero_optimization": zero}


def run(variant: str, args: argparse.Namespace) -> dict:
    model = build_gpt(args.preset, SEED)
    shapes = [tuple(p.shape) for p in model.parameters()]  # stage 3 empties the parameters it partitions
    engine = shardwise.initialize(model, config(variant, args))
    batches = ByteBatches(SEED, 1, args.micro_batch, args.seq_len)
    seconds, losses = [], []
    for step in range(args.steps):
        inputs, targets = batches.batch(step, 0)
        started = time.perf_counter()
        loss = engine(inputs, targets)
        engine.backward(loss)
        engine.step()
        seconds.append(time.perf_counter() - started)
        losses.append(float(loss.detach()))
    result = {"variant": variant, "seconds": seconds, "losses": losses,
              "moved": engine.comm_volume(per_group=True).get("offload", {}),
              "partition": engine.num_parameters() + engine.padding_elements(),
              "shapes": shapes}
    if engine.zenflow is not None:
        result["updates"] = [engine.zenflow.schedule.updates(m) for m in range(args.steps)]
    engine.destroy()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="10m")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=4, help="first steps left out of the timings")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--topk", type=float, default=0.1)
    parser.add_argument("--update-interval", type=int, default=4)
    parser.add_argument("--select-interval", type=int, default=100)
    parser.add_argument("--stage", type=int, choices=(2, 3), default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {variant: run(variant, args) for variant in ("none", "offload", "zenflow", "zenflow-overlap")}
    base = statistics.median(results["none"]["seconds"][args.warmup:])
    tail = max(1, args.steps // 4)
    print(f"ZeRO stage {args.stage}, GPT {args.preset}, {results['none']['partition']:,} elements, {args.steps} steps "
          f"(timings: last {args.steps - args.warmup}), micro-batch {args.micro_batch} x {args.seq_len} tokens")
    print(f"{'variant':<24}{'median step s':>14}{'x none':>8}{'loss, last quarter':>20}")
    for variant, result in results.items():
        timed = result["seconds"][args.warmup:]
        loss = statistics.mean(result["losses"][-tail:])
        print(f"{variant:<24}{statistics.median(timed):>14.4f}{statistics.median(timed) / base:>8.2f}{loss:>20.4f}")
        if variant.startswith("zenflow"):
            flags = result["updates"][args.warmup:]
            for label, wanted in (("  steps with CPU update", True), ("  steps without", False)):
                picked = [s for s, flag in zip(timed, flags) if flag == wanted]
                print(f"{label:<24}{statistics.median(picked):>14.4f}{statistics.median(picked) / base:>8.2f}")
    offload, zen, overlapped = results["offload"], results["zenflow"], results["zenflow-overlap"]
    for name, result in (("zenflow", zen), ("zenflow-overlap", overlapped)):
        drift = statistics.mean(result["losses"][-tail:]) / statistics.mean(offload["losses"][-tail:]) - 1
        print(f"{name} loss vs synchronous offload, last quarter: {drift:+.2%}")
    partition, steps = zen["partition"], args.steps
    plain = offload_transfer_bytes(partition, 2, grad_bytes=4, param_bytes=4)
    selected = zenflow_selected_elements(zen["shapes"], args.topk)
    expected = zenflow_transfer_bytes(partition, selected, steps=steps, updates=sum(zen["updates"]),
                                      selective_steps=steps, grad_bytes=4, param_bytes=4)
    # overlap_step without warm-up: the first two updates land nothing on the device
    landed = zenflow_transfer_bytes(partition, selected, steps=steps, updates=max(0, sum(overlapped["updates"]) - 2),
                                    selective_steps=steps, grad_bytes=4, param_bytes=4)
    for name, moved, formula in (("offload", offload["moved"], {k: v * steps for k, v in plain.items()}),
                                 ("zenflow", zen["moved"], expected), ("zenflow-overlap", overlapped["moved"], landed)):
        per_step = {key: value / steps / 1e6 for key, value in moved.items()}
        by_formula = {key: value / steps / 1e6 for key, value in formula.items()}
        print(f"{name} MB per step: device->host {per_step['device_to_host']:.2f}, host->device "
              f"{per_step['host_to_device']:.2f} (formula: {by_formula['device_to_host']:.2f}, "
              f"{by_formula['host_to_device']:.2f})")


if __name__ == "__main__":
    main()
