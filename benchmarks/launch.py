"""Start one benchmark variant on N fresh local processes and collect each rank's result.

Every variant (DDP, a ZeRO stage, FSDP2, DeepSpeed) gets processes of its own because
peak RSS is a per-process high-water mark: a rank that ran DDP and then ZeRO-1 would
report DDP's peak for both. Plain `subprocess` rather than a fork server, so a rank's RSS
is what its framework needs from a clean interpreter (nothing preloaded), and so a
variant can run under another interpreter (DeepSpeed lives in its own virtual env).

The ranks meet through a file store (no port to race for); each writes its result as
JSON into a fresh directory, which the parent reads once every rank has exited 0.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from report import VariantSummary, machine_line, median_over_rounds, summarise

REPO_ROOT = Path(__file__).resolve().parent.parent
STORE_VARIABLE = "BENCHMARK_STORE"
RESULT_DIR_VARIABLE = "BENCHMARK_RESULT_DIR"
POLL_S = 0.2


def run_rounds(
    script: Path,
    variants: list[str],
    worker_argv: Callable[[str], list[str]],
    world_size: int,
    timeout_s: float,
    rounds: int,
    python_for: Callable[[str], str] = lambda variant: sys.executable,
    env: dict[str, str] | None = None,
    optional: frozenset[str] = frozenset(),
) -> tuple[dict[str, VariantSummary], dict[str, list[list[dict[str, Any]]]]]:
    """Run every variant once per round, in turn; returns summaries and the raw results.

    Interleaving rounds (A B C, A B C) rather than repeating each variant in a row spreads
    a drift in the machine's load over all variants instead of charging it to one. A
    variant in `optional` that fails is reported and left out; any other failure raises.
    """
    raw: dict[str, list[list[dict[str, Any]]]] = {name: [] for name in variants}
    per_round: dict[str, list[VariantSummary]] = {name: [] for name in variants}
    for round_index in range(rounds):
        for name in [name for name in variants if name in per_round]:
            load = os.getloadavg()[0]
            print(f"round {round_index + 1}/{rounds}: {name} (load {load:.2f}) ...", flush=True)
            try:
                results = run_ranks(script, worker_argv(name), world_size, timeout_s, python_for(name), env)
            except VariantFailed as error:
                if name not in optional:
                    raise
                print(f"{name} failed and is left out of the comparison: {error}", flush=True)
                del per_round[name], raw[name]
                continue
            raw[name].append(results)
            per_round[name].append(summarise(name, results, load))
    return {name: median_over_rounds(summaries) for name, summaries in per_round.items()}, raw


def compare_in_rounds(
    script: Path,
    args: argparse.Namespace,
    *,
    worker: Callable[[argparse.Namespace], None],
    worker_argv: Callable[[argparse.Namespace, str], list[str]],
    world_size: int,
    report: Callable[[argparse.Namespace, dict[str, VariantSummary]], None],
) -> None:
    """A comparison benchmark's main: as one of its ranks (`args.worker`), the worker;
    otherwise the machine's line, every variant of `args.variants` over `args.rounds`
    interleaved rounds (`run_rounds`), the report, and with `args.json` the raw results."""
    if args.worker:
        worker(args)
        return
    print(machine_line(), flush=True)
    results, raw = run_rounds(script, args.variants.split(","), lambda name: worker_argv(args, name), world_size,
                              args.timeout, args.rounds)
    report(args, results)
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "results": raw}, indent=1))


class VariantFailed(RuntimeError):
    """A rank exited non-zero or the variant ran past its timeout; carries the rank's log."""


def run_ranks(
    script: Path,
    worker_args: list[str],
    world_size: int,
    timeout_s: float,
    python: str = sys.executable,
    env: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Run `python script worker_args` as ranks 0..world_size-1; return their results by rank.

    A rank's stdout and stderr go to a log file that is shown when it fails (DeepSpeed's
    start-up logging would otherwise bury the tables).
    """
    with tempfile.TemporaryDirectory(prefix="shardwise-bench-") as workdir:
        environment = {
            **os.environ,
            **(env or {}),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
            STORE_VARIABLE: os.path.join(workdir, "store"),
            RESULT_DIR_VARIABLE: workdir,
        }
        ranks: list[tuple[subprocess.Popen, Path]] = []
        try:
            for rank in range(world_size):
                log_path = Path(workdir, f"rank{rank}.log")
                with open(log_path, "w") as log:
                    process = subprocess.Popen(
                        [python, str(script), *worker_args],
                        env={**environment, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        cwd=REPO_ROOT,
                    )
                ranks.append((process, log_path))
            _wait_for_all(ranks, deadline=time.monotonic() + timeout_s, timeout_s=timeout_s)
        finally:
            for process, _ in ranks:
                if process.poll() is None:
                    process.kill()
                    process.wait()
        return [json.loads(Path(workdir, f"rank{rank}.json").read_text()) for rank in range(world_size)]


def _wait_for_all(ranks: list[tuple[subprocess.Popen, Path]], deadline: float, timeout_s: float) -> None:
    """Return when every rank exited 0; raise as soon as one fails or time runs out."""
    while True:
        codes = [process.poll() for process, _ in ranks]
        for rank, code in enumerate(codes):
            if code not in (None, 0):
                raise VariantFailed(f"rank {rank} exited with {code}:\n{_tail(ranks[rank][1])}")
        if all(code == 0 for code in codes):
            return
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- rank {rank} ---\n{_tail(log)}" for rank, (_, log) in enumerate(ranks))
            raise VariantFailed(f"still running after {timeout_s:.0f}s:\n{logs}")
        time.sleep(POLL_S)


def _tail(log_path: Path, lines: int = 40) -> str:
    return "\n".join(log_path.read_text(errors="replace").splitlines()[-lines:])
