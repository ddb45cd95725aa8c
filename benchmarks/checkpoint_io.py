"""Checkpoint save and load: time and peak extra RSS per ZeRO stage (issue 4, C8).

    .venv/bin/python benchmarks/checkpoint_io.py              # ≈100M GPT, 2 ranks, stages 0-3

Each stage runs on fresh rank processes: build the model, take one AdamW step (so the
optimizer state exists), save, load back into the same engine, then load into a second,
freshly built engine (the resume case). "Extra" is how far a rank's peak RSS rose above
its RSS just before the operation (the peak is reset through /proc/self/clear_refs
first): what saving or loading costs beyond the model states the rank already holds.
A fresh engine has no optimizer state yet, so loading into one allocates it (up to the
"optimizer state / rank" column; less where the allocator reuses memory that building
the model freed, as stage 3 does after partitioning). Times are the slowest rank's,
extras the largest rank's.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve()
sys.path.insert(0, str(SCRIPT.parent))
sys.path.insert(0, str(SCRIPT.parent.parent))

from report import machine_line  # noqa: E402

import shardwise  # noqa: E402
from shardwise.models import GPT, GPTConfig  # noqa: E402
from shardwise.tools.testing import run_distributed  # noqa: E402

MIB = 1024 * 1024


def status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def reset_peak_rss() -> int:
    """Reset the kernel's peak-RSS mark to the current RSS and return that RSS."""
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")
    return status_kib("VmRSS")


def build_engine(preset: str, stage: int, dtype: str):
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset(preset))
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "bf16": {"enabled": dtype == "bf16"},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
    }
    return shardwise.initialize(model, config)


def timed(engine, operation) -> tuple[float, int]:
    """(seconds, peak extra RSS bytes) of `operation`, started together on all ranks."""
    gc.collect()
    engine.comm.barrier("benchmark: start together")
    before = reset_peak_rss()
    start = time.perf_counter()
    operation()
    seconds = time.perf_counter() - start
    return seconds, max(0, status_kib("VmHWM") - before)


def measure(rank: int, world_size: int, preset: str, stage: int, dtype: str, directory: str) -> dict:
    engine = build_engine(preset, stage, dtype)
    tokens = torch.randint(0, 256, (1, 65), generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
    engine.step()
    tag = f"stage{stage}"
    save_s, save_extra = timed(engine, lambda: engine.save_checkpoint(directory, tag=tag))
    reload_s, reload_extra = timed(engine, lambda: engine.load_checkpoint(directory, tag=tag))
    optimizer_state = engine.memory_breakdown()["optimizer_states"]
    del engine
    fresh = build_engine(preset, stage, dtype)
    load_s, load_extra = timed(fresh, lambda: fresh.load_checkpoint(directory, tag=tag))
    return {
        "save_s": save_s, "save_extra": save_extra, "reload_s": reload_s, "reload_extra": reload_extra,
        "load_s": load_s, "load_extra": load_extra, "optimizer_state": optimizer_state,
        "params": fresh.num_parameters(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="100m", help="GPTConfig preset (default: 100m)")
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: a temp dir)")
    args = parser.parse_args(argv)

    print(machine_line())
    root = Path(args.dir or tempfile.mkdtemp(prefix="shardwise-checkpoint-io-"))
    print(f"GPT preset {args.preset}, {args.dtype}, AdamW, {args.ranks} ranks, checkpoints under {root}")
    print("times: slowest rank; extra: largest rank's peak RSS rise during the operation\n")
    print("| stage | checkpoint | optimizer state / rank | save s | save extra | load into trained engine s | "
          "extra | load into fresh engine s | extra |")
    print("|---|---|---|---|---|---|---|---|---|")
    for stage in args.stages:
        directory = root / f"stage{stage}"
        results = run_distributed(measure, args.ranks, args.preset, stage, args.dtype, str(directory), timeout=1800)
        size = sum(path.stat().st_size for path in (directory / f"stage{stage}").iterdir())
        slowest = {key: max(r[key] for r in results) for key in ("save_s", "reload_s", "load_s")}
        largest = {key: max(r[key] for r in results) / MIB
                   for key in ("save_extra", "reload_extra", "load_extra", "optimizer_state")}
        print(
            f"| {stage} | {size / MIB:,.0f} MiB | {largest['optimizer_state']:,.0f} MiB "
            f"| {slowest['save_s']:.2f} | {largest['save_extra']:,.0f} MiB "
            f"| {slowest['reload_s']:.2f} | {largest['reload_extra']:,.0f} MiB "
            f"| {slowest['load_s']:.2f} | {largest['load_extra']:,.0f} MiB |",
            flush=True,
        )
        shutil.rmtree(directory)
    print(f"\nafter: {machine_line()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
