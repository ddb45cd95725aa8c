"""Single-GPU GPT speed: MFU of shardwise at ZeRO stages 0 and 3, with and without
`compile.enabled`, beside the same model under plain PyTorch (issue 24, check 3).

The model is shardwise's GPT (flash attention, tied embedding) at the largest depth whose
predicted peak fits the device (gpt_sizes.py: the planner's formulas, no trial runs), in
bf16 with fp32 master weights and AdamW. Each variant runs in a fresh process (its own
allocator and CUDA context: one variant's cached blocks cannot starve the next) for
`--warmup` optimizer steps (compilation happens there) and `--steps` timed ones, each of
`--accumulation` micro-batches, synchronised before the clock is read.

    plain    the model itself: fp32 weights, bf16 autocast, torch's fused AdamW, clipping;
             compiled: the same per-block `torch.compile` shardwise uses (compile_blocks)
    stage0   shardwise.initialize, ZeRO stage 0 (bf16 weights, fp32 masters)
    stage3   ZeRO stage 3 at one rank: the parameter hooks (gather, release, prefetch)
             run as on many ranks, so stage 3 / stage 0 - 1 is what the hooks cost

MFU = model FLOPs per token (GPT.flops_per_token, PaLM's 6N + attention) x tokens/s over
the device's dense bf16 peak (shardwise.tools.profiling.flops: 989 TFLOP/s for an H100 SXM).
Goals (the issue's): MFU >= 50% at stage 0 compiled; stage 3's hooks <= 5%.

    python3 benchmarks/gpu/gpt_speed.py --budget 150
    python3 benchmarks/gpu/gpt_speed.py --toy                  # CPU rehearsal, tiny sizes
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys

import harness
import gpt_sizes

import torch  # noqa: E402  (after harness: the repository is on sys.path)

# compiled first: the goal's number, and the one compilation (the second run finds Inductor's cache)
ORDER = (("stage0", True), ("stage3", True), ("stage0", False), ("stage3", False), ("plain", False), ("plain", True))
MFU_GOAL = 0.5
HOOK_OVERHEAD_GOAL = 0.05
SUB_GROUP = gpt_sizes.DEFAULT_SUB_GROUP
# seconds kept back for each later run when a run's timeout is set: eager, compiled
RESERVE = {False: 15.0, True: 25.0}
FULL = {"hidden": 4096, "heads": 32, "vocab": 50304, "seq_len": 2048, "micro_batch": 2, "accumulation": 4,
        "warmup": 2, "steps": 3}
TOY = {"hidden": 64, "heads": 4, "vocab": 256, "seq_len": 64, "micro_batch": 2, "accumulation": 2,
       "warmup": 1, "steps": 2}
TOY_MEMORY = 8 * 2**20  # stands in for the device's memory in the toy plan: a few layers


def engine_config(stage: int, compiled: bool, micro_batch: int, accumulation: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "zero_optimization": {"stage": stage, "sub_group_size": SUB_GROUP, "reduce_bucket_size": "auto",
                              "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto"},
        "compile": {"enabled": compiled},
    }


def build_gpt(shape: gpt_sizes.Shape, layers: int, device: torch.device):
    """shardwise's GPT with `layers` blocks, initialised on `device` (seconds on a GPU
    rather than minutes on the host for billions of parameters)."""
    from shardwise.models import GPT, GPTConfig

    torch.manual_seed(0)
    config = GPTConfig(vocab_size=shape.vocab, block_size=shape.seq_len, n_layer=layers, n_head=shape.heads,
                       n_embd=shape.hidden, dropout=0.0, bias=True)
    with torch.device(device):
        return GPT(config)


def training_step(variant: str, compiled: bool, model, shape: gpt_sizes.Shape, accumulation: int,
                  device: torch.device):
    """A closure running one optimizer step of `accumulation` micro-batches; returns the last loss."""
    generator = torch.Generator(device=device).manual_seed(1)
    x = torch.randint(0, shape.vocab, (shape.micro_batch, shape.seq_len), device=device, generator=generator)
    y = torch.randint(0, shape.vocab, (shape.micro_batch, shape.seq_len), device=device, generator=generator)
    if variant == "plain":
        from shardwise.runtime.compile import compile_blocks

        if compiled:
            compile_blocks(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1,
                                      fused=device.type == "cuda")

        def plain_step() -> torch.Tensor:
            for _ in range(accumulation):
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    loss = model(x, y)
                (loss / accumulation).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss

        return plain_step, None
    import shardwise

    stage = 0 if variant == "stage0" else 3
    engine = shardwise.initialize(model, engine_config(stage, compiled, shape.micro_batch, accumulation))

    def engine_step() -> torch.Tensor:
        for _ in range(accumulation):
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
        return loss

    return engine_step, engine


def one_run(args: argparse.Namespace, device: torch.device) -> dict:
    """One variant in this process: the numbers of its timed steps."""
    import time

    shape = gpt_sizes.Shape(args.hidden, args.heads, args.vocab, args.seq_len, args.micro_batch)
    variant, compiled = args.one[0], args.one[1] == "compiled"
    harness.reset_memory(device)
    started = time.perf_counter()
    losses: list[float] = []
    try:
        model = build_gpt(shape, args.layers, device)
        num_params = sum(p.numel() for p in model.parameters())
        flops_per_token = model.flops_per_token()
        step, engine = training_step(variant, compiled, model, shape, args.accumulation, device)
        setup_s = time.perf_counter() - started
        warm = harness.time_call(lambda: losses.append(step().item()), device, 0, args.warmup)
        seconds = harness.time_call(lambda: losses.append(step().item()), device, 0, args.steps)
    except Exception as error:  # out of memory is a result (the formula was wrong); anything else a crash
        if not harness.is_out_of_memory(error):
            raise
        return {"outcome": "oom", "error": str(error).splitlines()[0][:300], "memory": harness.cuda_memory(device)}
    tokens = args.accumulation * shape.micro_batch * shape.seq_len
    step_s = harness.median(seconds)
    peak, source = harness.peak_flops(device, torch.bfloat16)
    achieved = flops_per_token * tokens / step_s
    result = {"outcome": "ok", "variant": variant, "compiled": compiled, "num_params": num_params,
              "flops_per_token": flops_per_token, "tokens_per_step": tokens, "setup_s": setup_s,
              "warmup_s": warm, "step_s": seconds, "tokens_per_s": tokens / step_s, "tflops": achieved / harness.TFLOP,
              "mfu": achieved / peak, "peak_flops": peak, "peak_source": source, "losses": losses,
              "memory": harness.cuda_memory(device)}
    if engine is not None:
        result["memory_breakdown"] = engine.memory_breakdown()
    if compiled:  # whether the blocks really ran compiled: graphs made, and where Dynamo fell back to eager
        from torch._dynamo.utils import counters

        result["dynamo"] = {"unique_graphs": counters["stats"]["unique_graphs"],
                            "graph_breaks": dict(counters["graph_break"])}
    if not all(math.isfinite(loss) for loss in losses):
        result["outcome"] = "error"
        result["error"] = f"non-finite loss: {losses}"
    return result


def child_argv(args: argparse.Namespace, variant: str, compiled: bool, layers: int, device: torch.device) -> list[str]:
    return [__file__, "--one", variant, "compiled" if compiled else "eager", "--layers", str(layers),
            "--device", device.type, "--hidden", str(args.hidden), "--heads", str(args.heads),
            "--vocab", str(args.vocab), "--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch),
            "--accumulation", str(args.accumulation), "--warmup", str(args.warmup), "--steps", str(args.steps)]


def judge(runs: dict[str, dict], toy: bool) -> tuple[str, str, dict]:
    """Status, summary and the derived numbers (MFU per run, stage 3 over stage 0)."""
    def ok(key: str) -> dict | None:
        run = runs.get(key)
        return run if run is not None and run.get("outcome") == "ok" else None

    derived: dict = {"mfu": {key: run["mfu"] for key in runs if (run := ok(key))}}
    parts = [f"{key} {run['mfu']:.1%}" for key in runs if (run := ok(key))]
    failed = [f"{key} {run.get('outcome')}" for key, run in runs.items() if run.get("outcome") != "ok"]
    for mode in ("eager", "compiled"):
        zero, three = ok(f"stage0-{mode}"), ok(f"stage3-{mode}")
        if zero and three:
            derived[f"stage3_overhead_{mode}"] = harness.median(three["step_s"]) / harness.median(zero["step_s"]) - 1
        plain, engine = ok(f"plain-{mode}"), ok(f"stage0-{mode}")
        if plain and engine:
            derived[f"stage0_vs_plain_{mode}"] = harness.median(plain["step_s"]) / harness.median(engine["step_s"])
    overheads = [f"{mode} {derived[f'stage3_overhead_{mode}']:+.1%}" for mode in ("eager", "compiled")
                 if f"stage3_overhead_{mode}" in derived]
    summary = "MFU " + (", ".join(parts) or "none measured")
    sizes = {run["num_params"] for run in runs.values() if run.get("outcome") == "ok"}
    if sizes:
        summary = f"GPT {harness.count(max(sizes))}: " + summary
    if overheads:
        summary += "; stage-3 hooks " + ", ".join(overheads)
    if failed:
        summary += "; " + ", ".join(failed)
    if toy:
        return ("PASS" if not failed else "FAIL"), "toy (goals not judged): " + summary, derived
    compiled = ok("stage0-compiled")
    misses = [f"{key} crashed" for key, run in runs.items() if run.get("outcome") == "error"]
    if compiled is None or compiled["mfu"] < MFU_GOAL:
        misses.append(f"stage-0 compiled MFU {compiled['mfu']:.1%} < {MFU_GOAL:.0%}" if compiled
                      else "no stage-0 compiled MFU")
    for mode in ("eager", "compiled"):
        overhead = derived.get(f"stage3_overhead_{mode}")
        if overhead is None or overhead > HOOK_OVERHEAD_GOAL:
            misses.append(f"stage-3 {mode} overhead " + (f"{overhead:+.1%}" if overhead is not None else "unmeasured"))
    if misses:
        summary = "goal missed (" + "; ".join(misses) + "): " + summary
    return ("PASS" if not misses else "FAIL"), summary, derived


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_common_arguments(parser)
    for name, value in FULL.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, help=f"(default {value}; toy {TOY[name]})")
    parser.add_argument("--memory-fraction", type=float, default=0.9,
                        help="share of the device's memory the predicted peak may use")
    parser.add_argument("--runs", nargs="+", default=None, metavar="VARIANT-MODE",
                        help="which runs, in order (default: " + " ".join(f"{v}-{'compiled' if c else 'eager'}"
                                                                          for v, c in ORDER) + ")")
    parser.add_argument("--layers", type=int, default=None, help="depth (default: the largest that fits)")
    parser.add_argument("--one", nargs=2, metavar=("VARIANT", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    defaults = TOY if args.toy else FULL
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    device = harness.pick_device(args.device)
    if args.one:
        harness.emit(one_run(args, device))
        return
    if (skip := harness.refuse_cpu_at_full_size(device, args.toy, "speed")) is not None:
        harness.emit(skip, args.json_out)
        return
    deadline = harness.Deadline(args.budget)
    shape = gpt_sizes.Shape(args.hidden, args.heads, args.vocab, args.seq_len, args.micro_batch)
    memory = harness.device_memory_bytes(device, TOY_MEMORY)
    order = [(run.rsplit("-", 1)[0], run.endswith("-compiled")) for run in args.runs] if args.runs else list(ORDER)
    plan = gpt_sizes.largest_fitting(shape, memory, sorted({variant for variant, _ in order}), args.memory_fraction,
                                     workspace_bytes=0 if device.type == "cpu" else int(1.5 * harness.GIB))
    layers = args.layers or plan.layers
    print(f"plan: {layers} layers, {harness.count(shape.num_params(layers))} parameters, predicted peak "
          + ", ".join(f"{v} {plan.peak(v) / harness.GIB:.1f} GiB" for v in plan.predicted)
          + f" of {memory / harness.GIB:.1f} GiB", flush=True)
    runs: dict[str, dict] = {}
    for index, (variant, compiled) in enumerate(order):
        key = f"{variant}-{'compiled' if compiled else 'eager'}"
        reserve = sum(RESERVE[c] for _, c in order[index + 1:])
        timeout = None if args.budget is None else deadline.left() - reserve
        if timeout is not None and timeout < RESERVE[compiled] / 2:
            runs[key] = {"outcome": "timeout", "error": "no time left in the budget"}
            continue
        print(f"{key}: running (timeout {timeout if timeout is None else round(timeout)} s)", flush=True)
        runs[key] = harness.run_child(child_argv(args, variant, compiled, layers, device), timeout)
        run = runs[key]
        print(f"{key}: {run.get('outcome')}" + (f", MFU {run['mfu']:.1%}, step {harness.median(run['step_s']):.3f} s"
                                                if run.get("outcome") == "ok" else f": {run.get('error', '')}"), flush=True)
    status, summary, derived = judge(runs, args.toy)
    numbers = {"shape": dataclasses.asdict(shape), "layers": layers,
               "num_params": shape.num_params(layers), "accumulation": args.accumulation,
               "predicted_peak": {v: plan.peak(v) for v in plan.predicted}, "predicted_terms": plan.predicted,
               "device_memory": memory, **derived, "runs": runs, **harness.environment(device)}
    goal = f"stage-0 compiled MFU >= {MFU_GOAL:.0%}; stage-3 hooks cost <= {HOOK_OVERHEAD_GOAL:.0%} (eager and compiled)"
    harness.emit(harness.Result("speed", status, summary, goal, numbers), args.json_out)
    sys.exit(1 if status == "FAIL" else 0)


if __name__ == "__main__":
    main()
