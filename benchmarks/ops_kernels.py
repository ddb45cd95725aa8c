"""Fused kernels (shardwise.runtime.ops) and a compiled GPT block vs the unfused torch code, on CPU (issue 15).

Each case runs forward + backward in fresh processes with one intra-op thread (the 2 cores
are shared with other jobs; an unscheduled second OpenMP thread stalls every parallel
region): one for the time, one for memory with MALLOC_MMAP_THRESHOLD_=65536, so that large
tensors are returned to the system when freed and the peak resident memory above the
inputs (VmHWM, reset through /proc/self/clear_refs before the measured step) is the peak of
live tensors. Warm-up steps (which include Inductor's compilation) are not measured.
Times are wall clock and the process's CPU time (time.process_time), each the best of the
repeats: with one thread and a loaded machine, the CPU time is what the step itself costs,
the wall time adds the waits for a core.

    unfused    the plain torch code the operator replaces, eager
    fused      shardwise.runtime.ops' operator, its bodies compiled by Inductor (C++ on CPU)
    compiled   torch.compile of the unfused code (where a comparison with it is meaningful)

Cases: RMSNorm, LayerNorm, bias + GeLU, SwiGLU, linear + batch norm + ReLU (training,
and evaluation with folded weights), linear + cross-entropy at vocabulary 32k, and one
block of the 10m GPT. The seed's fusion example (linear + batch norm + activation) is
also shown through the profiler: kernels launched and bytes allocated by each variant.

    .venv/bin/python benchmarks/ops_kernels.py
    .venv/bin/python benchmarks/ops_kernels.py --cases rms_norm bias_gelu --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

MIB = 1024 * 1024
RESULTS = Path(__file__).parent / "results"
ROWS, WIDTH = 8192, 1024  # activations of 8 sequences x 1024 tokens at width 1024


def _status(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) * 1024 / MIB
    raise RuntimeError(field)


def _leaf(*shape, scale=1.0):
    import torch

    return (torch.randn(*shape) * scale).requires_grad_()


def build(case: str, variant: str) -> Callable[[], None]:
    """A closure running one forward + backward of `case` in `variant`."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from shardwise.runtime.ops import activations, linear_bn_act, norms
    from shardwise.runtime.ops.fused_linear_cross_entropy import fused_linear_cross_entropy

    def backward_of(fn, inputs):
        def step():
            out = fn(*inputs)
            out.backward(torch.ones_like(out))
            for t in inputs:
                t.grad = None
        return step

    if case == "rms_norm":
        x, w = _leaf(ROWS, WIDTH), _leaf(WIDTH)
        unfused = lambda x, w: w * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6))
        fns = {"unfused": unfused, "fused": norms.rms_norm, "compiled": torch.compile(unfused)}
        return backward_of(fns[variant], [x, w])
    if case == "layer_norm":
        x, w, b = _leaf(ROWS, WIDTH), _leaf(WIDTH), _leaf(WIDTH)
        unfused = lambda x, w, b: F.layer_norm(x, (WIDTH,), w, b)
        fns = {"unfused": unfused, "fused": norms.layer_norm, "compiled": torch.compile(unfused)}
        return backward_of(fns[variant], [x, w, b])
    if case == "bias_gelu":
        x, b = _leaf(ROWS, 4 * WIDTH), _leaf(4 * WIDTH)
        unfused = lambda x, b: F.gelu(x + b, approximate="tanh")
        fns = {"unfused": unfused, "fused": lambda x, b: activations.bias_gelu(x, b, "tanh"),
               "compiled": torch.compile(unfused)}
        return backward_of(fns[variant], [x, b])
    if case == "swiglu":
        a, b = _leaf(ROWS, 4 * WIDTH), _leaf(ROWS, 4 * WIDTH)
        unfused = lambda a, b: F.silu(a) * b
        fns = {"unfused": unfused, "fused": activations.swiglu, "compiled": torch.compile(unfused)}
        return backward_of(fns[variant], [a, b])
    if case in ("linear_bn_relu_train", "linear_bn_relu_eval"):
        torch.manual_seed(0)
        stack = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.ReLU())
        module = stack if variant == "unfused" else linear_bn_act.FusedLinearBatchNormAct.from_modules(
            stack[0], stack[1], "relu")
        x = _leaf(ROWS, WIDTH)
        if case.endswith("eval"):
            module.eval()

            def infer():
                with torch.no_grad():
                    module(x)
            return infer
        return backward_of(module, [x])
    if case == "linear_cross_entropy":
        tokens, hidden, vocab = 4096, 512, 32000
        h, w = _leaf(tokens, hidden), _leaf(vocab, hidden, scale=0.02)
        targets = torch.randint(0, vocab, (tokens,))
        fns = {"unfused": lambda h, w: F.cross_entropy(F.linear(h, w).float(), targets),
               "fused": lambda h, w: fused_linear_cross_entropy(h, w, targets)}
        return backward_of(fns[variant], [h, w])
    if case == "gpt_block":
        from shardwise.models.gpt import Block, GPTConfig
        from shardwise.runtime.compile import compile_blocks

        config = GPTConfig.preset("10m")
        model = nn.ModuleList([Block(config)])
        if variant == "compiled":
            compile_blocks(nn.Sequential(model))
        x = _leaf(8, config.block_size, config.n_embd)
        return backward_of(model[0], [x])
    raise ValueError(case)


VARIANTS = {
    "rms_norm": ("unfused", "compiled", "fused"), "layer_norm": ("unfused", "compiled", "fused"),
    "bias_gelu": ("unfused", "compiled", "fused"), "swiglu": ("unfused", "compiled", "fused"),
    "linear_bn_relu_train": ("unfused", "fused"), "linear_bn_relu_eval": ("unfused", "fused"),
    "linear_cross_entropy": ("unfused", "fused"), "gpt_block": ("unfused", "compiled"),
}


def measure(case: str, variant: str, repeats: int) -> dict:
    import torch

    torch.set_num_threads(1)
    step = build(case, variant)
    for _ in range(3):  # warm-up, compilation included
        step()
    Path("/proc/self/clear_refs").write_text("5")
    before = _status("VmRSS")
    times, cpu_times = [], []
    for _ in range(repeats):
        start, cpu_start = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
    return {"case": case, "variant": variant, "ms": 1000 * min(times), "cpu_ms": 1000 * min(cpu_times),
            "peak_mib": _status("VmHWM") - before, "threads": torch.get_num_threads()}


def profile_seed_example() -> list[str]:
    """Kernels launched and bytes allocated by linear + batch norm + ReLU, unfused vs fused (eval)."""
    import torch
    from torch import nn
    from torch.profiler import ProfilerActivity, profile

    from shardwise.runtime.ops.linear_bn_act import FusedLinearBatchNormAct

    stack = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.ReLU()).eval()
    fused = FusedLinearBatchNormAct.from_modules(stack[0], stack[1], "relu").eval()
    x = torch.randn(ROWS, WIDTH)
    lines = ["| variant | top-level ops | bytes allocated | in activations of ROWS x WIDTH |", "|---|---|---|---|"]
    with torch.no_grad():
        for name, module in (("unfused (eval)", stack), ("fused (eval, folded)", fused)):
            module(x)
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                module(x)
            top = [e for e in prof.events() if e.cpu_parent is None and e.name != "[memory]"]
            allocated = sum(max(e.cpu_memory_usage, 0) for e in top)  # inclusive of each op's children
            full = ROWS * WIDTH * 4
            lines.append(f"| {name} | {', '.join(e.name for e in top)} | {allocated / MIB:.0f} MiB "
                         f"| {allocated / full:.1f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--one", nargs=2, metavar=("CASE", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(*args.one, args.repeats)))
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from report import machine_line

    def one(case: str, variant: str, repeats: int, env: dict) -> dict:
        out = subprocess.run([sys.executable, __file__, "--one", case, variant, "--repeats", str(repeats)],
                             env=env, check=True, capture_output=True, text=True).stdout
        return json.loads(out.strip().splitlines()[-1])

    rows = []
    for case in args.cases:
        for variant in VARIANTS[case]:
            timed = one(case, variant, args.repeats, dict(os.environ))
            memory = one(case, variant, 1, {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})
            rows.append({**memory, "ms": timed["ms"], "cpu_ms": timed["cpu_ms"]})
    print(machine_line() + "; 1 intra-op thread per measurement")
    print("| case | variant | ms (best of repeats) | speed-up vs unfused | CPU ms | CPU speed-up "
          "| peak MiB above inputs | memory vs unfused |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        base = next(r for r in rows if r["case"] == row["case"] and r["variant"] == "unfused")
        print(f"| {row['case']} | {row['variant']} | {row['ms']:.1f} | {base['ms'] / row['ms']:.2f}x "
              f"| {row['cpu_ms']:.1f} | {base['cpu_ms'] / row['cpu_ms']:.2f}x "
              f"| {row['peak_mib']:.0f} | {row['peak_mib'] / max(base['peak_mib'], 1e-9):.2f} |")
    print("\nThe seed's example through the profiler (linear + batch norm + ReLU, evaluation):\n")
    print("\n".join(profile_seed_example()))
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "ops_kernels.json"  # rows of cases not run this time are kept
    measured = {(row["case"], row["variant"]) for row in rows}
    kept = [row for row in (json.loads(path.read_text()) if path.exists() else [])
            if (row["case"], row["variant"]) not in measured]
    path.write_text(json.dumps(kept + rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
