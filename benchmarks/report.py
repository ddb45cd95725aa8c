"""Turning per-rank results into the numbers BENCHMARKS.md records.

The tables are printed as Markdown so a run's output can be pasted as it is.
"""

from __future__ import annotations

import os
import platform
import statistics
from dataclasses import dataclass
from typing import Any

MIB = 1024 * 1024


def machine_line() -> str:
    """Machine, software and the load right now (other jobs share this machine's cores)."""
    import torch

    load = ", ".join(f"{value:.2f}" for value in os.getloadavg())
    allocator = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("MALLOC_"))
    return (
        f"machine: {os.cpu_count()} CPU cores, {platform.machine()}, {platform.system()}, "
        f"torch {torch.__version__}, gloo; allocator: glibc malloc {allocator or 'defaults'}; "
        f"load average (1/5/15 min): {load}"
    )


@dataclass
class VariantSummary:
    """One variant's numbers, reduced over ranks the way the targets are stated."""

    name: str
    step_s: float  # median over timed steps of the slowest rank's step time
    cpu_s: float  # median over timed steps of the ranks' mean CPU time per step
    minor_faults: float  # median over timed steps of the ranks' mean minor page faults per step
    peak_rss: list[int]  # per rank
    baseline_rss: list[int]  # per rank, before the model was built
    losses: list[float]  # per step, mean over ranks
    load_at_start: float  # 1-minute load average when the variant started
    extra: dict[str, Any]  # rank 0's framework-specific measurements


def summarise(name: str, results: list[dict[str, Any]], load_at_start: float) -> VariantSummary:
    slowest_per_step = [max(times) for times in zip(*(result["seconds"] for result in results))]
    cpu_per_step = [statistics.fmean(times) for times in zip(*(result["cpu_seconds"] for result in results))]
    losses = [statistics.fmean(step) for step in zip(*(result["losses"] for result in results))]
    faults_per_step = [statistics.fmean(counts) for counts in zip(*(result.get("minor_faults", []) for result in results))]
    standard = {"variant", "seconds", "cpu_seconds", "minor_faults", "losses", "peak_rss", "baseline_rss"}
    return VariantSummary(
        name=name,
        step_s=statistics.median(slowest_per_step),
        cpu_s=statistics.median(cpu_per_step),
        minor_faults=statistics.median(faults_per_step) if faults_per_step else float("nan"),
        peak_rss=[result["peak_rss"] for result in results],
        baseline_rss=[result["baseline_rss"] for result in results],
        losses=losses,
        load_at_start=load_at_start,
        extra={key: value for key, value in results[0].items() if key not in standard},
    )


def median_over_rounds(rounds: list[VariantSummary]) -> VariantSummary:
    """Step time: the median round; memory and losses: the first round (load does not
    change them)."""
    middle = sorted(rounds, key=lambda summary: summary.step_s)[len(rounds) // 2]
    first = rounds[0]
    return VariantSummary(
        name=first.name,
        step_s=middle.step_s,
        cpu_s=middle.cpu_s,
        minor_faults=middle.minor_faults,
        peak_rss=first.peak_rss,
        baseline_rss=first.baseline_rss,
        losses=first.losses,
        load_at_start=statistics.fmean(summary.load_at_start for summary in rounds),
        extra=first.extra,
    )


def loss_difference(losses: list[float], reference: list[float]) -> tuple[float, float]:
    """(largest absolute, largest relative) difference over the steps."""
    absolute = max(abs(a - b) for a, b in zip(losses, reference))
    relative = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
    return absolute, relative


def mib(num_bytes: float) -> str:
    return f"{num_bytes / MIB:,.1f}"


def comm_text(volume: dict[str, int]) -> str:
    """Data collectives in MiB; the small "control" all-reduces (norms, checks) in bytes."""
    if not volume:
        return "not counted"
    return " / ".join(
        f"{op} {value} B" if op == "control" else f"{op} {mib(value)}" for op, value in volume.items()
    )


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows)]
    lines = [
        "| " + " | ".join(str(cell).ljust(width) for cell, width in zip(headers, widths)) + " |",
        "|" + "|".join("-" * (width + 2) for width in widths) + "|",
    ]
    for row in rows:
        lines.append("| " + " | ".join(str(cell).ljust(width) for cell, width in zip(row, widths)) + " |")
    return "\n".join(lines)


def verdict(met: bool) -> str:
    return "met" if met else "MISSED"
