"""Validation loss of the main job with each optimizer, against AdamW (issue 14, C16-C18).

    .venv/bin/python benchmarks/optimizer_convergence.py [--steps 200] [--out-dir runs/optimizers]
        [--only lamb,muon] [--plot benchmarks/results/optimizer_convergence.png]

Runs `shardwise train --optimizer NAME --stage 0` (the main job: GPT 10m, 2 ranks, the
default data, schedule and seed; stage 0 because the 1-bit optimizers need it, and every
optimizer gives the same numbers at every stage) for each optimizer, one after the
other, skipping those whose run directory already holds a summary (so an interrupted
sweep resumes). Prints a Markdown table of final validation loss against AdamW's with the
issue's targets (within 3% for LAMB, Adafactor, 8-bit Adam and Muon, 5% for 1-bit Adam /
LAMB; LARS has none) and plots the training-loss curves side by side.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
NAMES = ("adamw", "lamb", "lars", "adafactor", "adam8bit", "muon", "onebitadam", "onebitlamb")
TARGETS = {"lamb": 0.03, "adafactor": 0.03, "adam8bit": 0.03, "muon": 0.03, "onebitadam": 0.05, "onebitlamb": 0.05}
SMOOTHING = 10  # steps in the moving average of the plotted training loss


def run(name: str, steps: int, out_dir: Path) -> float | None:
    """Train with `name` unless its run exists; wall seconds of the run (None if reused)."""
    if (out_dir / name / "summary.json").exists():
        return None
    started = time.perf_counter()
    command = [str(Path(sys.executable).parent / "shardwise"), "train", "--optimizer", name, "--stage", "0", "--steps",
               str(steps), "--out-dir", str(out_dir), "--name", name]
    subprocess.run(command, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def read(run_dir: Path) -> tuple[list[float], float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    summary = json.loads((run_dir / "summary.json").read_text())
    return [record["loss"] for record in records], summary["final"]["val_loss"]


def smoothed(values: list[float], window: int) -> list[float]:
    return [sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
            for i in range(len(values))]


def plot(curves: dict[str, list[float]], finals: dict[str, float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (full, late) = plt.subplots(1, 2, figsize=(13, 4.8))
    for name, losses in curves.items():
        style = "-" if name == "adamw" else ("--" if name.startswith("onebit") else "-.")
        line = smoothed(losses, SMOOTHING)
        steps = range(1, len(losses) + 1)
        full.plot(steps, line, style, label=f"{name} (val {finals[name]:.3f})", linewidth=2 if name == "adamw" else 1)
        late.plot(steps, line, style, linewidth=2 if name == "adamw" else 1)
    last = min(len(losses) for losses in curves.values())
    late.set_xlim(last // 2, last)
    late.set_ylim(min(min(smoothed(c, SMOOTHING)[last // 2 :]) for c in curves.values()) - 0.05,
                  max(max(smoothed(c, SMOOTHING)[last // 2 :]) for c in curves.values()) + 0.05)
    for axis, title in ((full, "training loss"), (late, "second half")):
        axis.set_xlabel("step")
        axis.set_ylabel(f"cross-entropy, {SMOOTHING}-step moving average")
        axis.set_title(f"GPT 10m, main job, 2 ranks: {title}")
        axis.grid(alpha=0.3)
    full.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out-dir", type=Path, default=REPO / "runs" / "optimizers")
    parser.add_argument("--only", default=",".join(NAMES), help="comma-separated names (adamw is always read)")
    parser.add_argument("--plot", type=Path, default=REPO / "benchmarks" / "results" / "optimizer_convergence.png")
    args = parser.parse_args()
    names = [name for name in NAMES if name == "adamw" or name in args.only.split(",")]
    walls = {}
    for name in names:
        walls[name] = run(name, args.steps, args.out_dir)
        print(f"{name}: done" + (f" in {walls[name]:.0f} s" if walls[name] else " (existing run)"), flush=True)
    curves, finals = {}, {}
    for name in names:
        curves[name], finals[name] = read(args.out_dir / name)
    plot(curves, finals, args.plot)
    base = finals["adamw"]
    print(f"\n{args.steps} steps; plot: {args.plot.relative_to(REPO) if args.plot.is_relative_to(REPO) else args.plot}")
    print("| optimizer | validation loss | vs AdamW | target | met |")
    print("|---|---|---|---|---|")
    for name in names:
        change = finals[name] / base - 1
        target = TARGETS.get(name)
        verdict = "" if target is None else ("yes" if change <= target else "no")
        print(f"| {name} | {finals[name]:.4f} | {change:+.2%} | {'' if target is None else f'≤ +{target:.0%}'} | "
              f"{verdict} |")


if __name__ == "__main__":
    main()
