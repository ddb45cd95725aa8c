"""CUDA memory per recomputation policy, with and without ZeRO-R's contiguous checkpoint
buffer (issue 24, check 6; C9, C10).

For each policy (none, selective, every_k, full, sqrt) and, where checkpoints exist,
`activation_checkpointing.contiguous_memory_optimization` off and on, one engine trains
shardwise's GPT (bf16, ZeRO stage 2, one rank) for `--steps` steps after a warm-up step,
and reports, from the caching allocator over the measured steps:

    peak_allocated            live tensor bytes at the peak
    peak_reserved             bytes the allocator held from CUDA at its peak
    reserved - allocated      after the last step, and at the peaks: cached but unused
    inactive_split            the part of that inside segments that also hold live tensors
                              (fragmentation proper: free bytes a large request cannot use)
    segments                  cudaMalloc'd segments (after the step, and at the peak)
    alloc_retries             allocations that failed once and needed the cache flushed

beside the engine's own count of activation bytes (saved-tensor hooks) and the formula's
(shardwise/formulas/activation.py). The runs share one process, one after another, each
after `empty_cache()` so it starts from an empty cache; a byte vocabulary keeps the
logits small, so the layers' activations dominate.

    python3 benchmarks/gpu/recompute_memory.py --budget 45
    python3 benchmarks/gpu/recompute_memory.py --toy
"""

from __future__ import annotations

import argparse
import sys

import harness

import torch  # noqa: E402

POLICIES = ("none", "selective", "every_k", "full", "sqrt")
FULL = {"hidden": 2048, "heads": 16, "layers": 8, "seq_len": 2048, "micro_batch": 8, "steps": 2}
TOY = {"hidden": 64, "heads": 4, "layers": 4, "seq_len": 64, "micro_batch": 2, "steps": 2}
VOCAB = 256
MIB = 2**20
MIN_SECONDS_PER_RUN = 4.0


def formula_activation_bytes(args: argparse.Namespace, policy: str, element_bytes: int) -> int:
    """The layers' activation peak under `policy` plus the head, by the planner's formulas
    (flash attention: no s^2 term; no dropout)."""
    from shardwise.runtime.activation.policy import RecomputePolicy
    from shardwise.formulas.activation import (
        LayerShape,
        activation_peak_bytes,
        head_bytes,
        layer_activation_bytes,
        selective_kept_bytes,
    )

    layer = LayerShape(args.seq_len, args.micro_batch, args.hidden, args.heads, element_bytes=element_bytes,
                       dropout=False, attention_core=False)
    head = head_bytes(layer, VOCAB)
    if policy == "none":
        return args.layers * layer_activation_bytes(layer) + head
    regions = RecomputePolicy(policy).regions(args.layers)
    cached = selective_kept_bytes(layer) if policy == "selective" else 0
    return activation_peak_bytes(layer, args.layers, regions, cached_per_layer=cached, outside=head)


def one_run(args: argparse.Namespace, device: torch.device, policy: str, contiguous: bool) -> dict:
    import shardwise
    from shardwise.models import GPT, GPTConfig

    harness.reset_memory(device)
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=VOCAB, block_size=args.seq_len, n_layer=args.layers, n_head=args.heads,
                       n_embd=args.hidden, dropout=0.0)
    engine = None
    try:
        with torch.device(device):
            model = GPT(config)
        engine = shardwise.initialize(model, {
            "train_micro_batch_size_per_gpu": args.micro_batch,
            "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "zero_optimization": {"stage": 2},
            "activation_checkpointing": {"policy": policy, "contiguous_memory_optimization": contiguous},
        })
        tokens = torch.randint(0, VOCAB, (args.micro_batch, args.seq_len + 1), device=device)

        def step() -> None:
            loss = engine(tokens[:, :-1], tokens[:, 1:])
            engine.backward(loss)
            engine.step()

        step()  # warm-up: optimizer state, the contiguous buffer's first sizing
        harness.synchronize(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        engine.activations.reset_peaks()
        seconds = harness.time_call(step, device, 0, args.steps)
        states, activations = engine.memory_breakdown(), engine.activations.breakdown()
        memory = harness.cuda_memory(device)
    except Exception as error:  # one policy's failure is its result; the others still run
        import traceback

        traceback.print_exc()
        outcome = "oom" if harness.is_out_of_memory(error) else "error"
        return {"outcome": outcome, "error": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}",
                "memory": harness.cuda_memory(device)}
    finally:
        if engine is not None:
            engine.destroy()
    if memory is not None:
        memory["peak_reserved_minus_peak_allocated"] = memory["peak_reserved"] - memory["peak_allocated"]
    element_bytes = 2
    return {"outcome": "ok", "policy": policy, "contiguous": contiguous, "step_s": harness.median(seconds),
            "memory": memory, "engine_activations": activations,
            "model_states": states["params"] + states["grads"] + states["optimizer_states"],
            "buffers": states["buffers"], "formula_activations": formula_activation_bytes(args, policy, element_bytes)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_common_arguments(parser)
    for name, value in FULL.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, help=f"(default {value}; toy {TOY[name]})")
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    args = parser.parse_args()
    for name, value in (TOY if args.toy else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    device = harness.pick_device(args.device)
    if (skip := harness.refuse_cpu_at_full_size(device, args.toy, "memory")) is not None:
        harness.emit(skip, args.json_out)
        return
    deadline = harness.Deadline(args.budget)
    plan = [(policy, contiguous) for policy in args.policies for contiguous in ((False,) if policy == "none" else (False, True))]
    runs: dict[str, dict] = {}
    for policy, contiguous in plan:
        key = f"{policy}{'+contiguous' if contiguous else ''}"
        if deadline.left() < MIN_SECONDS_PER_RUN:
            runs[key] = {"outcome": "timeout", "error": "no time left in the budget"}
            continue
        runs[key] = one_run(args, device, policy, contiguous)
        run = runs[key]
        memory = run.get("memory") or {}
        if run["outcome"] != "ok":
            print(f"{key}: {run['outcome']}: {run['error']}", flush=True)
            continue
        print(f"{key}: {run['outcome']}, peak allocated {memory.get('peak_allocated', 0) / MIB:,.0f} MiB, "
              f"reserved-allocated {memory.get('reserved_minus_allocated', 0) / MIB:,.0f} MiB, "
              f"engine activations {(run.get('engine_activations') or {}).get('total', 0) / MIB:,.1f} MiB, "
              f"formula {run.get('formula_activations', 0) / MIB:,.1f} MiB", flush=True)
    problems = [f"{key} {run['outcome']}" for key, run in runs.items() if run["outcome"] != "ok"]
    if device.type == "cuda":
        parts = [f"{key} {run['memory']['peak_allocated'] / harness.GIB:.1f}/"
                 f"{run['memory']['peak_reserved_minus_peak_allocated'] / harness.GIB:.2f}/{run['memory']['peak_segments']}"
                 for key, run in runs.items() if run["outcome"] == "ok"]
        summary = "peak GiB/unused reserved GiB/segments: " + ", ".join(parts)
    else:
        parts = [f"{key} {(run['engine_activations'] or {}).get('total', 0) / MIB:.1f}"
                 for key, run in runs.items() if run["outcome"] == "ok"]
        summary = "toy, no CUDA allocator: engine activation MiB " + ", ".join(parts)
    if problems:
        summary = ", ".join(problems) + "; " + summary
    numbers = {"settings": {name: getattr(args, name) for name in FULL}, "vocab": VOCAB, "runs": runs,
               **harness.environment(device)}
    goal = "every policy runs; numbers recorded (no target)"
    status = "FAIL" if problems else "PASS"
    harness.emit(harness.Result("memory", status, summary, goal, numbers), args.json_out)
    sys.exit(1 if status == "FAIL" else 0)


if __name__ == "__main__":
    main()
