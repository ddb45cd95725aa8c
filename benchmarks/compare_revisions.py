"""Did a change make shardwise slower or larger? One benchmark, two revisions, interleaved.

    .venv/bin/python benchmarks/compare_revisions.py BASE_REV benchmarks/zero_vs_ddp.py --rounds 5
    .venv/bin/python benchmarks/compare_revisions.py BASE_REV benchmarks/zero3_vs_fsdp2_deepspeed.py \\
        --rounds 3 -- --presets 25m --variants shardwise,fsdp2

BASE_REV is exported (`git archive`) into a temporary directory; the working tree is the
other side. Each round runs the benchmark once from each tree (one round of its own
variants, on fresh processes), alternating which tree goes first, so a drift in the
machine's load falls on both. Step times are compared as ratios to the benchmark's own
peer (DDP or FSDP2) measured in the same run, which cancels most of the machine's
run-to-run spread; peak RSS is compared directly. Printed: the median over rounds of each
variant's ratio on both revisions (wall-clock step time, and CPU time per step, which a
loaded machine disturbs less), and the change in percent.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

SCRIPT = Path(__file__).resolve()
sys.path.insert(0, str(SCRIPT.parent))

from report import markdown_table, mib, summarise  # noqa: E402

REPO_ROOT = SCRIPT.parent.parent
PEERS = ("ddp", "fsdp2")


def export(revision: str, into: Path) -> Path:
    archive = subprocess.run(["git", "archive", revision], cwd=REPO_ROOT, check=True, capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


def run_once(tree: Path, benchmark: str, extra: list[str], output: Path) -> dict[str, dict]:
    """One round of the benchmark from `tree`: per variant, step time, ratio to the peer, peak RSS."""
    command = [sys.executable, str(tree / benchmark), "--rounds", "1", "--json", str(output), *extra]
    subprocess.run(command, cwd=tree, check=True, stdout=subprocess.DEVNULL)
    raw = json.loads(output.read_text())["results"]
    if all(isinstance(value, dict) for value in raw.values()):  # keyed by model preset first
        raw = {f"{preset} {name}": rounds for preset, variants in raw.items() for name, rounds in variants.items()}
    summaries = {name: summarise(name, rounds[0], 0.0) for name, rounds in raw.items() if rounds}
    return {
        name: {"step_s": s.step_s, "ratio": s.step_s / _peer(summaries, name).step_s,
               "cpu_ratio": s.cpu_s / _peer(summaries, name).cpu_s, "peak_rss": max(s.peak_rss)}
        for name, s in summaries.items()
    }


def _peer(summaries: dict, name: str):
    """The peer measured beside `name` in the same run (and for the same preset, if any)."""
    prefix = name.rsplit(" ", 1)[0] + " " if " " in name else ""
    return next(summaries[prefix + peer] for peer in PEERS if prefix + peer in summaries)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", help="git revision to compare the working tree with")
    parser.add_argument("benchmark", help="benchmark script, relative to the repository root")
    parser.add_argument("--rounds", type=int, default=3)
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    args, extra = parser.parse_args(argv[:split]), argv[split + 1:]  # after --: the benchmark's own
    results: dict[str, list[dict]] = {"base": [], "current": []}
    with tempfile.TemporaryDirectory(prefix="shardwise-base-") as workdir:
        trees = {"base": export(args.base, Path(workdir) / "tree"), "current": REPO_ROOT}
        for round_index in range(args.rounds):
            order = ("base", "current") if round_index % 2 == 0 else ("current", "base")
            for side in order:
                print(f"round {round_index + 1}/{args.rounds}: {side}", flush=True)
                results[side].append(run_once(trees[side], args.benchmark, extra, Path(workdir) / f"{side}.json"))
    rows = []
    for name in results["current"][0]:
        if name.rsplit(" ", 1)[-1] in PEERS:
            continue
        base = [run[name] for run in results["base"]]
        current = [run[name] for run in results["current"]]
        base_ratio = statistics.median(r["ratio"] for r in base)
        current_ratio = statistics.median(r["ratio"] for r in current)
        base_cpu = statistics.median(r["cpu_ratio"] for r in base)
        current_cpu = statistics.median(r["cpu_ratio"] for r in current)
        base_rss = statistics.median(r["peak_rss"] for r in base)
        current_rss = statistics.median(r["peak_rss"] for r in current)
        rows.append([
            name, f"{base_ratio:.3f}", f"{current_ratio:.3f}", f"{100 * (current_ratio / base_ratio - 1):+.1f}%",
            f"{base_cpu:.3f}", f"{current_cpu:.3f}", f"{100 * (current_cpu / base_cpu - 1):+.1f}%",
            mib(base_rss), mib(current_rss), f"{100 * (current_rss / base_rss - 1):+.1f}%",
        ])
    print(f"\n{args.benchmark}, {args.rounds} interleaved rounds, base {args.base} vs working tree")
    print(markdown_table(["variant", "base x peer", "current x peer", "change", "base CPU x peer",
                          "current CPU x peer", "change", "base peak RSS MiB",
                          "current peak RSS MiB", "change"], rows))


if __name__ == "__main__":
    main()
