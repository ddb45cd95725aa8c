"""`shardwise tune` against an exhaustive grid over the same space (issue 27 item 4).

    .venv/bin/python benchmarks/autotune.py                         # GPT 10m, 2 gloo ranks
    .venv/bin/python benchmarks/autotune.py --profile speeds.json   # reuse a measured speed profile

In one run, on the script benchmarks/autotune_gpt.py:
1. `shardwise estimate --measure`'s probe measures this machine once (the time model's speeds);
2. `shardwise tune` with tuner_type gridsearch (no early stopping) measures every candidate that fits;
3. `shardwise tune` with tuner_type model_based (prune by the estimator, rank by the time
   model, measure in that order, stop after 5 trials without a better one) with
   tuner_num_trials = a quarter of the grid;
4. the grid's best few and the tuner's choice are measured again, alternating, `--repeats`
   times, and compared by their median: single trials on a shared machine are noisy.
Prints a markdown table with the load average at each phase.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "autotune_gpt.py"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="10m")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--micro-batches", default="2,4", help="the micro-batch sizes searched (powers of two)")
    parser.add_argument("--recompute", default="none,full")
    parser.add_argument("--tp-sizes", default="1", help="tensor_parallel sizes searched (1,2 adds TP)")
    parser.add_argument("--repeats", type=int, default=3, help="re-measurements of the best few")
    parser.add_argument("--best-few", type=int, default=3)
    parser.add_argument("--profile", type=Path, help="a speed profile to reuse instead of measuring")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/shardwise-autotune-bench"))
    return parser.parse_args()


def model_info(preset: str) -> tuple[dict, int, int]:
    import torch

    from shardwise.models import GPT, GPTConfig

    config = GPTConfig.preset(preset)
    with torch.device("meta"):
        params = sum(p.numel() for p in GPT(config).parameters())
    return ({"num_params": params, "hidden_size": config.n_embd, "num_layers": config.n_layer},
            config.n_head, config.vocab_size)


def tune(args: argparse.Namespace, folder: Path, tuner: str, trials: int, profile: Path) -> dict:
    sizes = [int(size) for size in args.micro_batches.split(",")]
    info, heads, vocab = model_info(args.preset)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
              "autotuning": {"tuner_type": tuner, "tuner_num_trials": trials,
                             "tuner_early_stopping": 5 if tuner == "model_based" else 10_000,
                             "min_train_micro_batch_size_per_gpu": min(sizes),
                             "max_train_micro_batch_size_per_gpu": max(sizes),
                             "num_tuning_micro_batch_sizes": len(sizes), "start_profile_step": 3,
                             "end_profile_step": 5, "model_info": info}}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "ds_config.json").write_text(json.dumps(config))
    command = [sys.executable, "-m", "shardwise.tools.cli.main", "tune", "--config", "ds_config.json",
               "--nproc", str(args.nproc), "--heads", str(heads), "--vocab-size", str(vocab),
               "--seq-len", str(args.seq_len), "--speed-profile", str(profile), "--recompute", args.recompute,
               "--tp-sizes", args.tp_sizes, str(SCRIPT), "--deepspeed_config", "ds_config.json",
               "--preset", args.preset, "--seq-len", str(args.seq_len)]
    started = time.perf_counter()
    subprocess.run(command, cwd=folder, check=True)
    report = json.loads((folder / "autotuning_results" / "report.json").read_text())
    report["seconds"] = time.perf_counter() - started
    return report


def remeasure(folder: Path, name: str) -> float:
    """One more run of a trial's own command; its throughput (samples/s)."""
    trial = folder / "autotuning_results" / name
    metrics = trial / "metrics.json"
    metrics.unlink(missing_ok=True)
    command = (trial / "cmd.txt").read_text().split()
    subprocess.run(command, cwd=folder, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.loads(metrics.read_text())["throughput"]


def main() -> None:
    args = parse_args()
    sys.path.insert(0, str(ROOT))
    from shardwise.models import GPTConfig
    from shardwise.tools.planner.measure import ProbeShape, measure

    if args.workdir.exists():
        shutil.rmtree(args.workdir)
    args.workdir.mkdir(parents=True)
    loads = {"probe": os.getloadavg()[0]}
    profile = args.profile
    if profile is None:
        gpt = GPTConfig.preset(args.preset)
        profile = args.workdir / "speeds.json"
        measure(profile, ranks=args.nproc, probe=ProbeShape(gpt.n_embd, gpt.n_head, args.seq_len,
                                                            max(int(s) for s in args.micro_batches.split(",")),
                                                            gpt.vocab_size, gpt.n_layer))
    loads["grid"] = os.getloadavg()[0]
    grid = tune(args, args.workdir / "grid", "gridsearch", 10_000, profile)
    budget = max(1, grid["trials"] // 4)
    loads["tuner"] = os.getloadavg()[0]
    tuned = tune(args, args.workdir / "tuner", "model_based", budget, profile)
    loads["repeats"] = os.getloadavg()[0]

    measured = sorted((row for row in grid["rows"] if row["measured"] is not None), key=lambda r: -r["measured"])
    contenders = [row["name"] for row in measured[:args.best_few]]
    if tuned["best"] not in contenders:
        contenders.append(tuned["best"])
    again: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(args.repeats):  # alternating, so a load change hits every contender alike
        for name in contenders:
            again[name].append(remeasure(args.workdir / "grid", name))
    medians = {name: statistics.median(values) for name, values in again.items()}
    best_name = max(medians, key=medians.get)
    loads["end"] = os.getloadavg()[0]

    print(f"\nGPT {args.preset}, seq {args.seq_len}, {args.nproc} gloo ranks; metric throughput (samples/s); "
          f"load average {', '.join(f'{k} {v:.2f}' for k, v in loads.items())}")
    print(f"grid: {grid['trials']} trials of {grid['candidates']} candidates ({grid['seconds']:.0f} s); "
          f"tuner: {tuned['trials']} trials (budget {budget}, {tuned['seconds']:.0f} s)")
    print("\n| config | single grid trial | repeated (median of "
          f"{args.repeats}) | vs best | tuner's pick | predicted rank |")
    print("|---|---:|---:|---:|:---:|---:|")
    ranks = {row["name"]: row["predicted_rank"] for row in tuned["rows"]}
    singles = {row["name"]: row["measured"] for row in grid["rows"]}
    for name in sorted(medians, key=lambda n: -medians[n]):
        print(f"| {name} | {singles[name]:.2f} | {medians[name]:.2f} | {100 * (medians[name] / medians[best_name] - 1):+.1f}% "
              f"| {'yes' if name == tuned['best'] else ''} | {ranks.get(name)} |")
    gap = medians[tuned["best"]] / medians[best_name] - 1
    print(f"\ntuner's choice {tuned['best']}: {100 * gap:+.1f}% from the best of the grid "
          f"({best_name}), with {tuned['trials']} trials against the grid's {grid['trials']} "
          f"({tuned['trials'] / grid['trials']:.0%})")


if __name__ == "__main__":
    main()
