"""Checkpoint save and load: time and peak extra RSS per ZeRO stage (issue 4, C8).

    .venv/bin/python benchmarks/checkpoint_io.py              # ≈100M GPT, 2 ranks, stages 0-3
    .venv/bin/python benchmarks/checkpoint_io.py --async      # the training stall of an asynchronous save

Each stage runs on fresh rank processes: build the model, take one AdamW step (so the
optimizer state exists), save, load back into the same engine, then load into a second,
freshly built engine (the resume case). "Extra" is how far a rank's peak RSS rose above
its RSS just before the operation (the peak is reset through /proc/self/clear_refs
first): what saving or loading costs beyond the model states the rank already holds.
A fresh engine has no optimizer state yet, so loading into one allocates it (up to the
"optimizer state / rank" column; less where the allocator reuses memory that building
the model freed, as stage 3 does after partitioning). Times are the slowest rank's,
extras the largest rank's.

`--async` measures instead what a save costs the training loop: a synchronous save, then
shardwise's asynchronous save (`save_checkpoint(asynchronous=True)`: the stall is until it
returns, the state copied to host memory; the write is until `wait_for_checkpoint()`
returns), each repeated `--repeats` times with one training step between saves (the
first asynchronous save allocates its host buffers, later ones reuse them), beside torch
DCP's `async_save` of the model's and optimizer's state dicts (stall: until it returns;
write: until its future completes), on the same engine.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
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


def measure_async(rank: int, world_size: int, preset: str, stage: int, dtype: str, directory: str,
                  repeats: int) -> dict:
    import torch.distributed.checkpoint as dcp

    engine = build_engine(preset, stage, dtype)
    tokens = torch.randint(0, 256, (1, 65), generator=torch.Generator().manual_seed(rank))

    def step() -> None:
        engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
        engine.step()

    def clock(operation) -> float:
        engine.comm.barrier("benchmark: start together")
        start = time.perf_counter()
        operation()
        return time.perf_counter() - start

    times: dict[str, list[float]] = {key: [] for key in ("sync", "stall", "write", "dcp_stall", "dcp_write")}
    dcp_group = torch.distributed.new_group(backend="gloo")
    for repeat in range(repeats):
        step()
        times["sync"].append(clock(lambda: engine.save_checkpoint(directory, tag=f"sync{repeat}")))
        step()
        started = time.perf_counter()
        times["stall"].append(clock(lambda: engine.save_checkpoint(directory, tag=f"async{repeat}",
                                                                   asynchronous=True)))
        engine.wait_for_checkpoint()
        times["write"].append(time.perf_counter() - started)
        step()
        state = {"model": engine.module.state_dict(), "optimizer": engine.optimizer.optimizer.state_dict()}
        started = time.perf_counter()
        future = None

        def dcp_save() -> None:
            nonlocal future
            future = dcp.async_save(state, checkpoint_id=f"{directory}/dcp{repeat}", process_group=dcp_group)

        times["dcp_stall"].append(clock(dcp_save))
        future.result()
        times["dcp_write"].append(time.perf_counter() - started)
    engine.destroy()
    return times


def main_async(args: argparse.Namespace, root: Path) -> None:
    print(f"{args.repeats} saves of each kind; the median, over saves but the first, of the slowest rank\n")
    print("| stage | checkpoint | sync save s | async stall s (first save) | async stall s | stall / sync "
          "| async write s | DCP async_save stall s | DCP stall / sync | DCP write s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for stage in args.stages:
        directory = root / f"async-stage{stage}"
        results = run_distributed(measure_async, args.ranks, args.preset, stage, args.dtype, str(directory),
                                  args.repeats, timeout=1800)
        later = range(1, args.repeats) if args.repeats > 1 else range(1)  # the first allocates host buffers
        median = {key: statistics.median(max(r[key][i] for r in results) for i in later) for key in results[0]}
        first_stall = max(r["stall"][0] for r in results)
        size = sum(path.stat().st_size for path in (directory / "sync0").iterdir())
        print(f"| {stage} | {size / MIB:,.0f} MiB | {median['sync']:.2f} | {first_stall:.3f} | {median['stall']:.3f} "
              f"| {median['stall'] / median['sync']:.1%} | {median['write']:.2f} | {median['dcp_stall']:.3f} "
              f"| {median['dcp_stall'] / median['sync']:.1%} | {median['dcp_write']:.2f} |", flush=True)
        shutil.rmtree(directory)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="100m", help="GPTConfig preset (default: 100m)")
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: a temp dir)")
    parser.add_argument("--async", dest="asynchronous", action="store_true",
                        help="measure the training stall of asynchronous saves (and torch DCP's async_save)")
    parser.add_argument("--repeats", type=int, default=3, help="--async: saves of each kind")
    args = parser.parse_args(argv)

    print(machine_line())
    root = Path(args.dir or tempfile.mkdtemp(prefix="shardwise-checkpoint-io-"))
    print(f"GPT preset {args.preset}, {args.dtype}, AdamW, {args.ranks} ranks, checkpoints under {root}")
    if args.asynchronous:
        main_async(args, root)
        print(f"\nafter: {machine_line()}")
        return 0
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
