"""ZeRO-3 with and without ZeRO++ on 4 ranks simulated as 2 nodes x 2 (issue 29, C28).

    .venv/bin/python benchmarks/zero_plus_plus.py                      # bytes and step time, ≈10M GPT
    .venv/bin/python benchmarks/zero_plus_plus.py --bf16               # the same in bf16 (the paper's units)
    .venv/bin/python benchmarks/zero_plus_plus.py --convergence        # the main job, 200 steps each

Bytes and step time: each variant (plain ZeRO-3, qwZ, hpZ, qgZ, all three) trains the same
seeded GPT (embeddings untied, so each parameter is gathered once per pass as the formulas
assume; a tied one is gathered by the embedding and again by the head) on the same batches on fresh rank processes (`topology.ranks_per_node` 2), and
reports per step: the bytes one node sends to the other (its ranks' `inter_node` counts,
beside `inter_node_bytes_per_node` from shardwise/formulas/communication.py), the bytes
that stay inside a node, each group's bytes, the step time (slowest rank, median), the
parameters' memory (hpZ's secondary partition) and the loss against plain ZeRO-3. On one
machine every "link" is loopback, so the step time shows what quantization costs in
compute, not what it saves on a network.

Convergence: `shardwise train` (the main job: GPT 10m, its data, schedule and seed) with
4 processes as 2 x 2 nodes, at stage 3 with fp32 communication and with ZeRO++ (int8
weights, hpZ over the node, int4 gradients); final validation loss and the training-loss
curves (`benchmarks/results/zero_plus_plus_convergence.png`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

SCRIPT = Path(__file__).resolve()
REPO = SCRIPT.parent.parent
sys.path.insert(0, str(SCRIPT.parent))

from launch import run_rounds  # noqa: E402
from report import VariantSummary, loss_difference, machine_line, markdown_table, mib  # noqa: E402

WORLD, PER_NODE = 4, 2
VARIANTS = {
    "zero3": {},
    "qwZ": {"zero_quantized_weights": True},
    "hpZ": {"zero_hpz_partition_size": PER_NODE},
    "qgZ": {"zero_quantized_gradients": True},
    "zero++": {"zero_quantized_weights": True, "zero_hpz_partition_size": PER_NODE,
               "zero_quantized_gradients": True},
}
CONVERGENCE_RUNS = ("zero3", "zero++")
SMOOTHING = 10


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="10m", help="GPTConfig preset")
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--bf16", action="store_true", help="bf16 parameters and gradients (fp32 masters)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--convergence", action="store_true", help="the main job with and without ZeRO++ instead")
    parser.add_argument("--train-steps", type=int, default=200, help="--convergence: steps per run")
    parser.add_argument("--out-dir", default="runs/zero_plus_plus", help="--convergence: run directories")
    parser.add_argument("--plot", type=Path, default=REPO / "benchmarks/results/zero_plus_plus_convergence.png")
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    return parser.parse_args()


def config(args: argparse.Namespace, variant: str) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_clipping": 1.0,
        "steps_per_print": 1_000_000,
        "bf16": {"enabled": args.bf16},
        "topology": {"ranks_per_node": PER_NODE},
        "zero_optimization": {"stage": 3, "overlap_comm": True, "stage3_param_persistence_threshold": 0,
                              "stage3_max_reuse_distance": 0, **VARIANTS[variant]},
    }


def worker(args: argparse.Namespace) -> None:
    import shardwise
    from shardwise.models import GPT, GPTConfig
    from workload import (ByteBatches, engine_step, init_process_group, rank_result, rss_bytes, timed_steps,
                          write_result)

    rank, world_size = init_process_group()
    baseline = rss_bytes()
    torch.manual_seed(args.seed)  # untied: each parameter gathered once per pass, as the formulas count
    model = GPT(dataclasses.replace(GPTConfig.preset(args.preset), tie_embeddings=False))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    engine = shardwise.initialize(model, config(args, args.worker), optimizer=optimizer)
    batches = ByteBatches(args.seed, world_size, args.micro_batch, args.seq_len)
    record = timed_steps(engine_step(engine), batches, rank, args.warmup, 0)  # warm-up, uncounted
    engine.reset_comm_volume()
    timed = timed_steps(engine_step(engine), batches, rank, 0, args.steps)
    record.seconds, record.cpu_seconds = timed.seconds, timed.cpu_seconds
    record.losses += timed.losses
    volume = engine.comm_volume(per_group=True)
    per_step = {group: {op: value // args.steps for op, value in ops.items() if value}
                for group, ops in volume.items()}
    units = [unit.padded_numel for unit in engine.zero.params.sharded.units]
    write_result(rank, rank_result(args.worker, record, baseline, comm=per_step, units=units,
                                   model_state=engine.memory_breakdown()))
    engine.destroy()
    torch.distributed.destroy_process_group()


def worker_argv(args: argparse.Namespace, variant: str) -> list[str]:
    argv = ["--worker", variant, "--preset", args.preset]
    for key in ("micro_batch", "seq_len", "warmup", "steps", "seed"):
        argv += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    return argv + (["--bf16"] if args.bf16 else [])


def formula_per_node(units: list[int], variant: str, element_bytes: int) -> int:
    from shardwise.formulas.communication import ZeroPlusPlusShape, inter_node_bytes_per_node

    chosen = VARIANTS[variant]
    return inter_node_bytes_per_node(ZeroPlusPlusShape(
        tuple(units), WORLD, PER_NODE, param_bytes=element_bytes, grad_bytes=element_bytes,
        quantized_weights=chosen.get("zero_quantized_weights", False),
        hpz_partition_size=chosen.get("zero_hpz_partition_size", 1),
        quantized_gradients=chosen.get("zero_quantized_gradients", False)))


def bytes_report(args: argparse.Namespace, results: dict[str, VariantSummary], raw: dict[str, Any]) -> None:
    element_bytes = 2 if args.bf16 else 4
    plain = results.get("zero3")
    rows = []
    for name, summary in results.items():
        ranks = raw[name][0]
        per_node = sum(sum(rank["comm"].get("inter_node", {}).values()) for rank in ranks[:PER_NODE])
        inside = sum(sum(rank["comm"].get("intra_node", {}).values()) for rank in ranks[:PER_NODE])
        plain_node = sum(sum(rank["comm"].get("inter_node", {}).values())
                         for rank in raw["zero3"][0][:PER_NODE]) if plain else None
        groups = ", ".join(
            f"{group} {' + '.join(f'{op} {mib(value)}' for op, value in ops.items() if op != 'control')}"
            for group, ops in ranks[0]["comm"].items()
            if group not in ("intra_node", "inter_node") and set(ops) != {"control"})
        loss = "-"
        if plain and name != "zero3":
            absolute, relative = loss_difference(summary.losses, plain.losses)
            loss = f"{absolute:.1e} / {relative:.1e}"
        rows.append([
            name, mib(per_node), _formula_text(per_node, formula_per_node(ranks[0]["units"], name, element_bytes)),
            f"{plain_node / per_node:.2f}" if plain_node else "-", mib(inside), groups,
            f"{summary.step_s:.3f}", f"{summary.step_s / plain.step_s:.2f}" if plain else "-",
            mib(summary.extra["model_state"]["params"]), loss, f"{summary.load_at_start:.2f}",
        ])
    print(markdown_table(
        ["variant", "MiB node 0 -> node 1 per step", "formula", "zero3 / this", "MiB inside node 0 per step",
         "rank 0's MiB per step by group", "step s (median)", "x zero3", "params MiB per rank",
         "loss diff vs zero3 (max abs / rel)", "load"], rows))


def _formula_text(measured: int, formula: int) -> str:
    return f"{mib(formula)} ({'equal to the byte' if measured == formula else f'{measured - formula:+,} B'})"


def convergence(args: argparse.Namespace) -> None:
    out = REPO / args.out_dir
    finals, curves = {}, {}
    for name in CONVERGENCE_RUNS:
        run_dir = out / name
        if not (run_dir / "summary.json").exists():
            config_path = out / f"{name}.json"
            out.mkdir(parents=True, exist_ok=True)
            config_path.write_text(json.dumps({"topology": {"ranks_per_node": PER_NODE},
                                               "zero_optimization": {"stage": 3, **VARIANTS[name]}}))
            print(f"training {name} ...", flush=True)
            subprocess.run([str(Path(sys.executable).parent / "shardwise"), "train", "--config", str(config_path),
                            "--nproc", str(WORLD), "--steps", str(args.train_steps), "--out-dir", str(out),
                            "--name", name], cwd=REPO, check=True, stdout=subprocess.DEVNULL)
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
        curves[name] = [record["loss"] for record in records]
        finals[name] = json.loads((run_dir / "summary.json").read_text())["final"]["val_loss"]
    base = finals["zero3"]
    print(markdown_table(["run", "validation loss", "vs fp32 communication", "last-10-step training loss"],
                         [[name, f"{loss:.4f}", f"{(loss - base) / base:+.2%}",
                           f"{sum(curves[name][-10:]) / 10:.4f}"] for name, loss in finals.items()]))
    plot(curves, finals, args.plot)


def plot(curves: dict[str, list[float]], finals: dict[str, float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.5))
    for name, losses in curves.items():
        smoothed = [sum(losses[max(0, i - SMOOTHING + 1) : i + 1]) / len(losses[max(0, i - SMOOTHING + 1) : i + 1])
                    for i in range(len(losses))]
        axis.plot(range(1, len(losses) + 1), smoothed, label=f"{name} (validation {finals[name]:.3f})")
    axis.set_xlabel("step")
    axis.set_ylabel(f"training loss, {SMOOTHING}-step moving average")
    axis.set_title("main job (GPT 10m), 4 ranks as 2 nodes x 2, ZeRO-3")
    axis.grid(alpha=0.3)
    axis.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    print(machine_line(), flush=True)
    if args.convergence:
        convergence(args)
        return
    variants = args.variants.split(",")
    print(f"settings: GPT {args.preset}, {WORLD} ranks as 2 nodes x {PER_NODE}, {'bf16' if args.bf16 else 'fp32'}, "
          f"seq {args.seq_len}, micro-batch {args.micro_batch} per rank, AdamW, stage 3 with every parameter "
          f"partitioned and re-gathered in backward; {args.warmup} warm-up + {args.steps} timed steps x "
          f"{args.rounds} round(s)", flush=True)
    results, raw = run_rounds(SCRIPT, variants, lambda name: worker_argv(args, name), WORLD, args.timeout,
                              args.rounds)
    bytes_report(args, results, raw)


if __name__ == "__main__":
    main()
