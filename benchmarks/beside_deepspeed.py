"""What the one-layer benchmarks beside DeepSpeed share (ulysses_attention.py,
moe_expert_parallel.py): one torchrun job under a DeepSpeed install's interpreter runs
shardwise's step and DeepSpeed's on the same inputs, one after the other; each rank writes
its step times, the largest difference of the results and shardwise's counted bytes; the
parent prints the slowest rank's median per side and their ratio."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch


def timed(step: Callable[[], list[torch.Tensor]], args: argparse.Namespace) -> tuple[list[float], list[torch.Tensor]]:
    """`args.warmup` untimed then `args.steps` timed calls, every rank starting together;
    the times and the last call's tensors."""
    import torch.distributed as dist

    times, result = [], []
    for index in range(args.warmup + args.steps):
        dist.barrier()
        started = time.perf_counter()
        result = step()
        if index >= args.warmup:
            times.append(time.perf_counter() - started)
    return times, result


def time_both_and_write(shardwise_step: Callable[[], list[torch.Tensor]],
                        deepspeed_step: Callable[[], list[torch.Tensor]], stats: Any, rank: int,
                        args: argparse.Namespace) -> None:
    """In a worker: time both sides, compare their results, write this rank's record."""
    ours, ours_result = timed(shardwise_step, args)
    steps = args.warmup + args.steps
    shardwise_bytes = {key: value // steps for key, value in stats.totals().items()}
    theirs, theirs_result = timed(deepspeed_step, args)
    difference = max((a - b).abs().max().item() for a, b in zip(ours_result, theirs_result))
    result = {"shardwise": ours, "deepspeed": theirs, "difference": difference, "shardwise_bytes": shardwise_bytes}
    (args.worker / f"{rank}.json").write_text(json.dumps(result))


def launch_and_summarize(script: str, args: argparse.Namespace, *, port: int,
                         environment: dict[str, str] | None = None) -> dict[str, Any]:
    """In the parent: run `script`'s workers under `args.deepspeed_python` and summarize
    every rank's records (exits with the job's output when it fails)."""
    if not Path(args.deepspeed_python).exists():
        sys.exit(f"no DeepSpeed interpreter at {args.deepspeed_python}: see benchmarks/zero3_vs_fsdp2_deepspeed.py "
                 "for the install commands, or pass --deepspeed-python")
    with tempfile.TemporaryDirectory(prefix=f"{Path(script).stem}-") as directory:
        argv = [f"--{name.replace('_', '-')}={value}" for name, value in vars(args).items()
                if name not in ("deepspeed_python", "worker")]
        command = [args.deepspeed_python, "-m", "torch.distributed.run", f"--nproc_per_node={args.world}",
                   f"--master_port={port}", str(Path(script).resolve()), *argv, "--worker", directory]
        env = os.environ | {"PYTHONPATH": str(Path(script).resolve().parent.parent), "OMP_NUM_THREADS": "1",
                            **(environment or {})}
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            sys.exit(f"the torchrun job failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
        results = [json.loads((Path(directory) / f"{rank}.json").read_text()) for rank in range(args.world)]
    summary: dict[str, Any] = {}
    for side in ("shardwise", "deepspeed"):
        per_step = [max(result[side][i] for result in results) for i in range(args.steps)]
        summary[f"{side}_step_s"] = round(statistics.median(per_step), 4)
    summary["shardwise_over_deepspeed"] = round(summary["shardwise_step_s"] / summary["deepspeed_step_s"], 3)
    summary["max_abs_difference"] = max(result["difference"] for result in results)
    summary["shardwise_bytes_per_step_rank0"] = results[0]["shardwise_bytes"]
    summary["load_average_1min"] = round(os.getloadavg()[0], 2)
    summary["args"] = {key: value for key, value in vars(args).items() if key != "worker"}
    return summary
