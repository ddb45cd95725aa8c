"""ZeRO-Offload's claim on one GPU: a model several times larger than fits without offload,
at a good fraction of the non-offload throughput (issue 24, check 4; C11, C12).

Two runs of shardwise's GPT, each at ZeRO stage 3 on one rank, built on the meta device
and initialised unit by unit on the GPU (a model the host could not hold twice):

    cpu    ZeRO-Offload: fp32 masters, Adam's moments and fp32 gradients in (pinned) host
           memory, the optimizer step on the CPU
    nvme   ZeRO-Infinity: the optimizer state and the 16-bit parameters in swap files on
           the local disk (`--nvme-path`), the gradient partition in host memory

each against the largest model without offload: the speed check's best eager engine run
(`--baseline speed.json`), or a stage-0 run of gpt_speed.py at its largest size when no
such file is given. Reported: parameters as a multiple of the baseline's, model TFLOP/s
(6N + attention per token; recomputation not counted) as a fraction of the baseline's.
Goal (the issue's): >= 4x the size at >= 40% of the TFLOP/s with CPU offload.

Sizes come from the formulas, not from trials: the largest Ψ whose offloaded model states
(shardwise/formulas/memory.py placed_model_state_bytes) fit 75% of the host memory (cpu) or 70% of
the disk's free space and the host (nvme), and whose run is predicted to finish in the time
given (with a margin of 2, `TIME_MARGIN`), from the host memory bandwidth (a copy,
measured), the rate of pinning host memory (measured: every offloaded byte is page-locked
before the first step) and the disk's direct-I/O
bandwidth (dd, measured): the budget, not the host, bounds the size in a 9-minute check.
The result says which bound chose each size. Every layer is recomputed in backward
(full policy), so the micro-batch's activations stay small beside the parameters, and
each step accumulates enough micro-batches for the GPU's work to match the CPU's step.

    python3 benchmarks/gpu/offload_scale.py --baseline /tmp/speed.json --budget 300
    python3 benchmarks/gpu/offload_scale.py --toy
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness
import gpt_sizes

import torch  # noqa: E402

from shardwise.formulas.memory import Offload, placed_model_state_bytes  # noqa: E402

SIZE_GOAL = 4.0
THROUGHPUT_GOAL = 0.4
HOST_FRACTION = 0.75
DISK_FRACTION = 0.7
CPU_ADAM_EFFICIENCY = 0.3  # CPU AdamW's bytes/s over a plain copy's (BENCHMARKS.md, offload on CPU)
ADAM_BYTES = 28  # per element: read master, gradient, two moments; write master, two moments
# the share of the predicted time a run is sized to take: the prediction missed twice (the
# H100's CPU run at 6.26B, host-bound, and the H200's at 5.85B, sized to 100 s, printed no
# step), and a smaller model's result is worth more than a larger one's timeout
TIME_MARGIN = 0.5
NVME_STEP_BYTES = 2 * 12 + 3 * 2  # optimizer state read + written; 16-bit parameters read twice, written once
SETUP_SECONDS = 20.0  # process start, CUDA context, engine construction besides the bytes
OFFLOADS = {"cpu": Offload(optimizer="cpu"), "nvme": Offload(optimizer="nvme", params="nvme")}
FULL = {"hidden": 4096, "heads": 32, "vocab": 50304, "seq_len": 2048, "micro_batch": 4, "warmup": 1, "steps": 1}
TOY = {"hidden": 64, "heads": 4, "vocab": 256, "seq_len": 64, "micro_batch": 2, "warmup": 1, "steps": 1}
TOY_HOST_MEMORY = 8 * 2**20  # stands in for the host's memory in the toy run: a few layers
TOY_DEVICE_MEMORY = 64 * 2**20
TOY_ACCUMULATION = 2
MAX_ACCUMULATION = 16
WORKSPACE = int(1.5 * 2**30)  # CUDA context and workspaces (gpt_sizes.py)


def host_bandwidth(gib: float = 1.0) -> float:
    """Bytes/s of a large host copy (read + write), the best of three."""
    source = torch.ones(int(gib * harness.GIB) // 4)
    target = torch.empty_like(source)
    best = math.inf
    for _ in range(3):
        started = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - started)
    return 2 * source.numel() * 4 / best


def pin_bandwidth(host_bw: float, gib: float = 1.0) -> float:
    """Bytes/s of allocating page-locked host memory (what every offloaded byte costs before
    the first step); without CUDA, a quarter of a copy's, as the sizing assumed before this
    was measured (the first H100 run's CPU-offload child did not reach its first step in
    65 s at 6.26B parameters, 100 GB pinned)."""
    if not torch.cuda.is_available():
        return host_bw / 4
    started = time.perf_counter()
    pinned = torch.empty(int(gib * harness.GIB), dtype=torch.uint8, pin_memory=True)
    seconds = time.perf_counter() - started
    del pinned
    return gib * harness.GIB / seconds


def disk_bandwidth(path: Path, megabytes: int) -> float:
    """The slower of the disk's direct-I/O write and read bandwidth (benchmarks/offload_io.py's dd)."""
    sys.path.insert(0, str(harness.REPO / "benchmarks"))
    from offload_io import dd_bandwidth

    return min(dd_bandwidth(path, megabytes))


def host_memory_bytes() -> int:
    import psutil

    return psutil.virtual_memory().total


def offload_bytes(num_params: int, kind: str) -> dict[str, int]:
    """Model-state bytes per tier (gpu / cpu / nvme) for `kind`, by the formulas."""
    placed = placed_model_state_bytes(num_params, 1, 3, OFFLOADS[kind], dtype="bf16")
    return {tier: sum(categories.values()) for tier, categories in placed.items()}


@dataclasses.dataclass
class Sizing:
    layers: int
    num_params: int
    bound: str  # host | disk | time | device
    bounds: dict[str, int]  # the largest Ψ each bound allows


def choose_size(shape: gpt_sizes.Shape, kind: str, seconds: float, host: int, host_bw: float, pin_bw: float,
                disk_free: int, disk_bw: float, device_memory: int, workspace_bytes: int) -> Sizing:
    """The largest Ψ every bound allows, rounded down to whole layers (see the module doc)."""
    per_param_host = offload_bytes(10**9, kind)["cpu"] / 10**9
    bounds = {"host": int(HOST_FRACTION * host / per_param_host)}
    if kind == "nvme":
        bounds["disk"] = int(DISK_FRACTION * disk_free / (offload_bytes(10**9, kind)["nvme"] / 10**9))
        per_param_seconds = (14 + 2 * NVME_STEP_BYTES) / disk_bw  # write it once, then two steps
    else:
        per_param_seconds = 16 / pin_bw + 2 * 2 * ADAM_BYTES / (CPU_ADAM_EFFICIENCY * host_bw)
    bounds["time"] = int(TIME_MARGIN * max(0.0, seconds - SETUP_SECONDS) / per_param_seconds)
    device_plan = gpt_sizes.largest_fitting(shape, device_memory, [f"offload_{kind}"], recompute="full",
                                            workspace_bytes=workspace_bytes)
    bounds["device"] = device_plan.num_params
    bound = min(bounds, key=bounds.get)
    layers = max(1, (bounds[bound] - shape.num_params(0)) // shape.block_params())
    return Sizing(layers, shape.num_params(layers), bound, bounds)


def offload_config(kind: str, nvme_path: str, shape: gpt_sizes.Shape, accumulation: int, pin: bool) -> dict:
    offload = {"device": kind, "pin_memory": pin}
    if kind == "nvme":
        offload["nvme_path"] = nvme_path
    zero = {"stage": 3, "offload_optimizer": offload, "sub_group_size": gpt_sizes.DEFAULT_SUB_GROUP,
            "stage3_param_persistence_threshold": "auto", "stage3_prefetch_bucket_size": "auto",
            "reduce_bucket_size": "auto"}
    if kind == "nvme":  # a parameter buffer holds the largest shard: at one rank, the (tied) embedding
        zero["offload_param"] = {**offload, "buffer_size": max(shape.vocab * shape.hidden, shape.block_params())}
    return {"train_micro_batch_size_per_gpu": shape.micro_batch, "gradient_accumulation_steps": accumulation,
            "gradient_clipping": 1.0, "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
            "zero_optimization": zero, "activation_checkpointing": {"policy": "full"}}


def one_run(args: argparse.Namespace, device: torch.device) -> dict:
    """One offloaded run in this process."""
    import shardwise
    from shardwise.models import GPT, GPTConfig

    kind = args.one
    shape = gpt_sizes.Shape(args.hidden, args.heads, args.vocab, args.seq_len, args.micro_batch)
    started = time.perf_counter()
    config = GPTConfig(vocab_size=shape.vocab, block_size=shape.seq_len, n_layer=args.layers, n_head=shape.heads,
                       n_embd=shape.hidden, dropout=0.0)
    with torch.device("meta"):
        model = GPT(config)
    flops_per_token = model.flops_per_token()
    num_params = sum(p.numel() for p in model.parameters())
    engine = shardwise.initialize(model, offload_config(kind, args.nvme_path, shape, args.accumulation, not args.no_pin),
                                  param_init_fn=GPT.init_weights)
    setup_s = time.perf_counter() - started
    # progress lines: a run its budget stops shows in the check's log how far it got (the
    # H200 run of 2026-11-28 stopped both offloaded runs without a line to say where)
    print(f"{kind}: {harness.count(num_params)} parameters initialised and placed in {setup_s:.1f} s", flush=True)
    generator = torch.Generator(device=device).manual_seed(1)
    x, y = (torch.randint(0, shape.vocab, (shape.micro_batch, shape.seq_len), device=device, generator=generator)
            for _ in range(2))
    losses: list[float] = []

    def step() -> None:
        for _ in range(args.accumulation):
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
        losses.append(loss.item())

    warm = harness.time_call(step, device, 0, args.warmup)
    print(f"{kind}: warm-up step(s) {', '.join(f'{t:.1f}' for t in warm)} s", flush=True)
    engine.reset_comm_volume()
    seconds = harness.time_call(step, device, 0, args.steps)
    tokens = args.accumulation * shape.micro_batch * shape.seq_len
    step_s = harness.median(seconds)
    return {"outcome": "ok" if all(map(math.isfinite, losses)) else "error", "kind": kind, "layers": args.layers,
            "num_params": num_params, "flops_per_token": flops_per_token, "tokens_per_step": tokens,
            "accumulation": args.accumulation, "setup_s": setup_s, "warmup_s": warm, "step_s": seconds,
            "tflops": flops_per_token * tokens / step_s / harness.TFLOP, "losses": losses,
            "tiers": engine.memory_breakdown(by_tier=True), "moved_per_step": engine.comm_volume(per_group=True).get("offload"),
            "memory": harness.cuda_memory(device)}


def baseline_from(path: Path | None) -> dict | None:
    """The best eager engine run of the speed check's result file."""
    if path is None or not path.exists():
        return None
    speed = json.loads(path.read_text())
    runs = [run for key, run in speed.get("runs", {}).items() if key.endswith("-eager") and not key.startswith("plain")
            and run.get("outcome") == "ok"]
    if not runs:
        return None
    best = max(runs, key=lambda run: run["tflops"])
    return {"source": str(path), "variant": f"{best['variant']}-eager", "num_params": best["num_params"],
            "tflops": best["tflops"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_common_arguments(parser)
    for name, value in FULL.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, help=f"(default {value}; toy {TOY[name]})")
    parser.add_argument("--baseline", type=Path, default=None, help="the speed check's JSON (gpt_speed.py --json-out)")
    parser.add_argument("--kinds", nargs="+", choices=tuple(OFFLOADS), default=list(OFFLOADS))
    parser.add_argument("--nvme-path", default=None, help="a directory on the local disk (default: a temporary one)")
    parser.add_argument("--host-gib", type=float, default=None, help="host memory to size for (default: all of it)")
    parser.add_argument("--cpu-share", type=float, default=0.65, help="share of the budget for the CPU run")
    parser.add_argument("--no-pin", action="store_true", help="do not pin the host buffers")
    parser.add_argument("--one", choices=tuple(OFFLOADS), help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--accumulation", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    for name, value in (TOY if args.toy else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    device = harness.pick_device(args.device)
    if args.one:
        harness.emit(one_run(args, device))
        return
    if (skip := harness.refuse_cpu_at_full_size(device, args.toy, "offload")) is not None:
        harness.emit(skip, args.json_out)
        return
    deadline = harness.Deadline(args.budget)
    shape = gpt_sizes.Shape(args.hidden, args.heads, args.vocab, args.seq_len, args.micro_batch)
    nvme_dir = Path(tempfile.mkdtemp(prefix="shardwise-nvme-", dir=args.nvme_path))
    numbers: dict = {"shape": dataclasses.asdict(shape), **harness.environment(device)}
    try:
        baseline = baseline_from(args.baseline)
        if baseline is None:
            baseline = run_baseline(args, device, deadline)
        numbers["baseline"] = baseline
        host = int(args.host_gib * harness.GIB) if args.host_gib else (
            TOY_HOST_MEMORY if args.toy else host_memory_bytes())
        copy_bw = host_bandwidth(0.05 if args.toy else 1.0)
        numbers["host"] = {"memory": host, "copy_bandwidth": copy_bw,
                           "pin_bandwidth": pin_bandwidth(copy_bw, 0.05 if args.toy else 1.0)}
        runs = {}
        if "nvme" in args.kinds:
            numbers["disk"] = {"path": str(nvme_dir), "free": shutil.disk_usage(nvme_dir).free}
            try:
                numbers["disk"]["direct_io_bandwidth"] = disk_bandwidth(nvme_dir, 16 if args.toy else 512)
            except subprocess.CalledProcessError as error:  # e.g. tmpfs: no O_DIRECT, and no disk behind it
                runs["nvme"] = {"outcome": "error", "error": f"no direct I/O at {nvme_dir} (dd: "
                                f"{error.stderr.strip().splitlines()[-1][:120] if error.stderr else error}); "
                                "give --nvme-path a folder on a local disk"}
        for kind in args.kinds:
            if kind not in runs:
                runs[kind] = run_offloaded(args, device, kind, shape, baseline, numbers, nvme_dir, deadline)
        numbers["runs"] = runs
    finally:
        shutil.rmtree(nvme_dir, ignore_errors=True)
    status, summary = judge(runs, baseline, args.toy)
    goal = f"CPU offload: >= {SIZE_GOAL:.0f}x the non-offload size at >= {THROUGHPUT_GOAL:.0%} of its TFLOP/s"
    harness.emit(harness.Result("offload", status, summary, goal, numbers), args.json_out)
    sys.exit(1 if status == "FAIL" else 0)


def run_baseline(args: argparse.Namespace, device: torch.device, deadline: harness.Deadline) -> dict | None:
    """No speed-check result: a stage-0 eager run of gpt_speed.py at its largest size."""
    out = Path(tempfile.mkdtemp(prefix="shardwise-baseline-")) / "speed.json"
    argv = [str(Path(__file__).with_name("gpt_speed.py")), "--runs", "stage0-eager", "--device", device.type,
            "--json-out", str(out)] + (["--toy"] if args.toy else [])
    if args.budget is not None:
        argv += ["--budget", str(deadline.left() * 0.3)]
    harness.run_child(argv, None if args.budget is None else deadline.left() * 0.3 + 10)
    return baseline_from(out)


def run_offloaded(args: argparse.Namespace, device: torch.device, kind: str, shape: gpt_sizes.Shape,
                  baseline: dict | None, numbers: dict, nvme_dir: Path, deadline: harness.Deadline) -> dict:
    share = args.cpu_share if kind == "cpu" and len(args.kinds) > 1 else 1.0
    seconds = deadline.left() * share if args.budget is not None else 3600.0
    disk = numbers.get("disk", {})
    device_memory = harness.device_memory_bytes(device, TOY_DEVICE_MEMORY)
    host = numbers["host"]
    sizing = choose_size(shape, kind, seconds, host["memory"], host["copy_bandwidth"], host["pin_bandwidth"],
                         disk.get("free", 0), disk.get("direct_io_bandwidth", 1.0), device_memory,
                         0 if device.type == "cpu" else WORKSPACE)
    accumulation = matching_accumulation(shape, sizing.num_params, baseline, numbers["host"]["copy_bandwidth"])
    if args.toy:
        accumulation = min(accumulation, TOY_ACCUMULATION)
    print(f"{kind}: {sizing.layers} layers, {harness.count(sizing.num_params)} parameters (bound: {sizing.bound}; "
          + ", ".join(f"{b} {harness.count(v)}" for b, v in sizing.bounds.items()) + f"), accumulation {accumulation}",
          flush=True)
    argv = [__file__, "--one", kind, "--layers", str(sizing.layers), "--accumulation", str(accumulation),
            "--nvme-path", str(nvme_dir), "--device", device.type]
    for name in FULL:
        argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    if args.no_pin:
        argv.append("--no-pin")
    run = harness.run_child(argv, None if args.budget is None else max(5.0, seconds))
    run["sizing"] = dataclasses.asdict(sizing)
    if run.get("outcome") == "ok" and baseline:
        run["size_ratio"] = run["num_params"] / baseline["num_params"]
        run["throughput_fraction"] = run["tflops"] / baseline["tflops"]
    return run


def matching_accumulation(shape: gpt_sizes.Shape, num_params: int, baseline: dict | None, host_bw: float) -> int:
    """Micro-batches per step for the GPU's work (at the baseline's TFLOP/s, 4/3 for the
    recomputation) to take as long as the predicted CPU optimizer step."""
    tflops = (baseline or {}).get("tflops", 300.0) * harness.TFLOP
    micro = 6 * num_params * shape.micro_batch * shape.seq_len * 4 / 3 / tflops
    cpu_step = ADAM_BYTES * num_params / (CPU_ADAM_EFFICIENCY * host_bw)
    return max(1, min(MAX_ACCUMULATION, math.ceil(cpu_step / micro)))


def judge(runs: dict, baseline: dict | None, toy: bool) -> tuple[str, str]:
    parts, failed = [], []
    for kind, run in runs.items():
        if run.get("outcome") != "ok":
            failed.append(f"{kind} {run.get('outcome')}: {run.get('error', '')[:120]}")
            continue
        text = f"{kind} {harness.count(run['num_params'])} ({run['sizing']['bound']}-bound) {run['tflops']:.3g} TFLOP/s"
        if "size_ratio" in run:
            text += f" = {run['size_ratio']:.1f}x size at {run['throughput_fraction']:.0%}"
        parts.append(text)
    base = (f"baseline {baseline['variant']} {harness.count(baseline['num_params'])} {baseline['tflops']:.3g} TFLOP/s"
            if baseline else "no baseline")
    summary = "; ".join(parts + failed + [base])
    if toy:
        return ("FAIL" if failed else "PASS"), "toy (goals not judged): " + summary
    cpu = runs.get("cpu", {})
    met = cpu.get("size_ratio", 0) >= SIZE_GOAL and cpu.get("throughput_fraction", 0) >= THROUGHPUT_GOAL
    if failed or not met:
        return "FAIL", ("goal missed: " if not failed else "") + summary
    return "PASS", summary


if __name__ == "__main__":
    main()
