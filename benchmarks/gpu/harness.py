"""What the GPU benchmarks share: the device, the toy (CPU rehearsal) switch, a time budget,
synchronised timing, CUDA allocator statistics, and the one JSON line each prints.

Every benchmark under benchmarks/gpu/ runs on one CUDA device at its real size, or with
`--toy` at a tiny size on whatever device there is (the CPU here), so that each code path
has run before the lent GPU's minutes are spent on it. Each prints its results as one JSON
line (the last line of its output), with a `status` (PASS / FAIL / SKIP), a `summary` of
its key numbers, and a `goal` saying what PASS means; scripts/gpu_check.sh turns that line
into the check's summary line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # usable alone: python3 benchmarks/gpu/NAME.py
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

GIB = 2**30
TFLOP = 1e12


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="auto: CUDA when available, else the CPU (then only --toy runs)")
    parser.add_argument("--toy", action="store_true",
                        help="tiny sizes, runnable on the CPU: the rehearsal of every code path")
    parser.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                        help="wall-clock seconds this benchmark may take; it plans its runs to fit and "
                        "reports the ones that did not as timed out (default: no limit)")
    parser.add_argument("--json-out", type=Path, default=None, metavar="FILE",
                        help="also write the result line to FILE")


def count(number: float) -> str:
    """A parameter count for people: 3.44B, 125M, 37.8k."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(number) >= scale:
            return f"{number / scale:.3g}{suffix}"
    return f"{number:.0f}"


def pick_device(choice: str) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: torch sees no CUDA device")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def refuse_cpu_at_full_size(device: torch.device, toy: bool, name: str) -> dict | None:
    """The SKIP result of a full-size run without CUDA (the sizes are an H100's), else None."""
    if device.type == "cuda" or toy:
        return None
    return {"check": name, "status": "SKIP", "summary": "no CUDA device (rehearse on the CPU with --toy)"}


class Deadline:
    """Seconds left of a benchmark's budget; `share(n)` splits what is left over n runs."""

    def __init__(self, budget: float | None):
        self.end = None if budget is None else time.monotonic() + budget

    def left(self) -> float:
        return math.inf if self.end is None else max(0.0, self.end - time.monotonic())

    def share(self, runs_left: int) -> float | None:
        """An even share of the time left for the next of `runs_left` runs (None: no limit)."""
        if self.end is None:
            return None
        return self.left() / max(1, runs_left)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(step: Callable[[], Any], device: torch.device, warmup: int, repeats: int) -> list[float]:
    """Seconds per call of `step`, each synchronised, after `warmup` calls (compilation,
    allocator growth and autotuning happen there)."""
    for _ in range(warmup):
        step()
    synchronize(device)
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        step()
        synchronize(device)
        seconds.append(time.perf_counter() - started)
    return seconds


def median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def reset_memory(device: torch.device) -> None:
    """Free cached blocks and restart the peak counters (CUDA; nothing to do on the CPU)."""
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def cuda_memory(device: torch.device) -> dict[str, int] | None:
    """The caching allocator's view: peak and current bytes allocated and reserved, the
    reserved bytes not holding tensors (reserved - allocated), the part of those that sits
    in split blocks (fragmentation proper: free space inside segments that also hold live
    tensors), the segments, and the cudaMalloc retries (allocations that first failed and
    needed the cache flushed). None off CUDA."""
    if device.type != "cuda":
        return None
    stats = torch.cuda.memory_stats(device)
    allocated, reserved = stats["allocated_bytes.all.current"], stats["reserved_bytes.all.current"]
    return {
        "peak_allocated": stats["allocated_bytes.all.peak"],
        "peak_reserved": stats["reserved_bytes.all.peak"],
        "allocated": allocated,
        "reserved": reserved,
        "reserved_minus_allocated": reserved - allocated,
        "inactive_split": stats["inactive_split_bytes.all.current"],
        "segments": stats["segment.all.current"],
        "peak_segments": stats["segment.all.peak"],
        "alloc_retries": stats["num_alloc_retries"],
    }


def device_memory_bytes(device: torch.device, toy_bytes: int) -> int:
    """Total memory of the CUDA device, or `toy_bytes` standing in for it on the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return toy_bytes


def peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """The device's dense peak FLOP/s for `dtype` (datasheet on known GPUs; measured on CPU)."""
    from shardwise.tools.profiling.flops import device_peak_flops

    peak = device_peak_flops(device, dtype)
    return peak.flops_per_second, peak.source


def environment(device: torch.device) -> dict[str, Any]:
    facts: dict[str, Any] = {"torch": torch.__version__, "python": sys.version.split()[0], "device": device.type}
    if device.type == "cuda":
        facts["device_name"] = torch.cuda.get_device_name(device)
        facts["cuda"] = torch.version.cuda
        facts["device_memory_gib"] = round(torch.cuda.get_device_properties(device).total_memory / GIB, 2)
    else:
        facts["cpu_threads"] = torch.get_num_threads()
    return facts


def is_out_of_memory(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()


@dataclass
class Result:
    """One benchmark's result line."""

    check: str
    status: str  # PASS | FAIL | SKIP
    summary: str
    goal: str
    numbers: dict[str, Any]

    def line(self) -> str:
        return json.dumps({"check": self.check, "status": self.status, "summary": self.summary,
                           "goal": self.goal, **self.numbers}, default=_jsonable)


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (torch.dtype, torch.device, Path)):
        return str(value)
    raise TypeError(f"not JSON: {type(value).__name__}")


def emit(result: Result | dict, json_out: Path | None = None) -> None:
    """Print the result line (last line of the output) and write it to `json_out`."""
    line = result.line() if isinstance(result, Result) else json.dumps(result, default=_jsonable)
    print(line, flush=True)
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(line + "\n")


def run_child(argv: list[str], timeout: float | None, log: Callable[[str], None] = print) -> dict:
    """Run `python3 argv...` in a fresh process (a clean CUDA context and allocator) and
    return its JSON result line; a timeout, crash or missing line becomes a result saying so."""
    import subprocess

    command = [sys.executable, *argv]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    started = time.monotonic()
    try:
        # same process group: the driver's own timeout (scripts/gpu_check.sh) reaches the child too
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as expired:
        _forward(expired.stdout, expired.stderr, log)
        # a result printed before the timeout counts: on the first H100 run a 3.4B plain
        # PyTorch run printed its steps and was still freeing its memory at the deadline
        result = _result_line(expired.stdout)
        if result is not None:
            result.setdefault("outcome", "ok")
            result.update(seconds=round(time.monotonic() - started, 1), exit="stopped after its result (timeout)")
            return result
        return {"outcome": "timeout", "seconds": round(time.monotonic() - started, 1),
                "error": f"no result within {timeout:.0f} s"}
    _forward(done.stdout, done.stderr, log)
    result = _result_line(done.stdout)
    if result is not None:
        result.setdefault("outcome", "ok" if done.returncode == 0 else "error")
        result["seconds"] = round(time.monotonic() - started, 1)
        return result
    tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
    return {"outcome": "error", "seconds": round(time.monotonic() - started, 1),
            "error": f"exit {done.returncode}: {tail[0][:300]}"}


def _result_line(stdout: str | bytes | None) -> dict | None:
    """The last JSON line a child printed, if any."""
    text = stdout.decode(errors="replace") if isinstance(stdout, bytes) else stdout or ""
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:  # cut off by the timeout
                return None
    return None


def _forward(stdout: str | bytes | None, stderr: str | bytes | None, log: Callable[[str], None]) -> None:
    """A child's output into this process's log, so that the check's log shows everything."""
    for stream in (stdout, stderr):
        if stream:
            text = stream.decode(errors="replace") if isinstance(stream, bytes) else stream
            for line in text.rstrip().splitlines():
                log(f"    | {line}")
