"""Kernels on the device: block-sparse attention against dense, a compiled GPT block against
eager, shardwise's fused operators against unfused torch (issue 24, check 5; C19, C20).

1. Attention, forward + backward, bf16, batch 1, BigBird's layout (one random block, a
   3-block window, one global block, bidirectional) with blocks of `--block` tokens, at
   `--length` tokens (8k):
     sparse        shardwise.runtime.ops.sparse_attention.SparseSelfAttention: on CUDA, flex_attention
                   with a BlockMask built from the layout once and cached (its build,
                   timed alone as `mask_build`, is not part of the call)
     dense_flash   scaled_dot_product_attention over all pairs (the kernel sparse replaces)
     dense_masked  the same pattern as a dense L x L boolean mask (what dense attention
                   must do to compute what sparse computes)
   sparse must equal the masked attention computed in fp32 (output and query gradient,
   relative error < 2e-2 in bf16); dense_masked's own errors against it are reported too.
   Goal: >= 3x faster than dense_flash.
2. One GPT block (the speed check's width, sequence and micro-batch, bf16), forward +
   backward: `compile_blocks` (torch.compile per block, as `compile.enabled`) vs eager.
3. The fused operators of benchmarks/ops_kernels.py (its cases, built on the device, fp32),
   unfused / fused / compiled, as far as the budget goes, at 16384 rows of width 4096 (a
   3B GPT's activations for 8 sequences of 2048): the CPU sizes (8192 x 1024) took under a
   millisecond per step on the H100, so the first run timed Python and launches, not kernels.

Times are medians of synchronised calls after warm-up calls (compilation happens there).

    python3 benchmarks/gpu/kernels.py --budget 60
    python3 benchmarks/gpu/kernels.py --toy
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import harness

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(harness.REPO / "benchmarks"))
import ops_kernels  # noqa: E402  (benchmarks/ops_kernels.py: the fused-operator cases)

SPARSE_GOAL = 3.0
BF16_TOLERANCE = 2e-2
FULL = {"length": 8192, "heads": 16, "head_dim": 128, "block": 128, "hidden": 4096, "block_heads": 32,
        "seq_len": 2048, "micro_batch": 2, "warmup": 3, "repeats": 10}
TOY = {"length": 256, "heads": 4, "head_dim": 16, "block": 16, "hidden": 64, "block_heads": 4,
       "seq_len": 64, "micro_batch": 2, "warmup": 1, "repeats": 2}
# ops_kernels' cases in order of interest; the toy run takes the small elementwise ones only
FUSED_CASES = ("linear_cross_entropy", "rms_norm", "bias_gelu", "swiglu", "layer_norm", "linear_bn_relu_train",
               "linear_bn_relu_eval")
TOY_FUSED_CASES = ("rms_norm", "bias_gelu")
TOY_ROWS, TOY_WIDTH = 64, 32
DEVICE_ROWS, DEVICE_WIDTH = 16384, 4096
MIN_SECONDS_PER_CASE = 8.0


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def attention_case(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict:
    from shardwise.runtime.ops.sparse_attention import BigBirdSparsityConfig, SparseSelfAttention
    from shardwise.runtime.ops.sparse_attention.flex import layout_block_mask

    random.seed(0)
    torch.manual_seed(0)
    attention = SparseSelfAttention(BigBirdSparsityConfig(args.heads, block=args.block), max_seq_length=args.length)
    layout = attention.get_layout(args.length)
    mask = layout[0].bool().repeat_interleave(args.block, 0).repeat_interleave(args.block, 1).to(device)
    shape = (1, args.heads, args.length, args.head_dim)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(shape, device=device, dtype=dtype)
    calls = {
        "sparse": lambda: attention(q, k, v),
        "dense_flash": lambda: F.scaled_dot_product_attention(q, k, v),
        "dense_masked": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
    }
    outputs = {}
    for name, call in calls.items():  # one call each first: the correctness check
        out = call()
        out.backward(grad)
        outputs[name] = (out.detach(), q.grad.detach().clone())
        q.grad = k.grad = v.grad = None
    # the masked attention once more in fp32: the judge of both 16-bit runs, so that a
    # disagreement says which of the two is off
    exact = [t.detach().float().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*exact, attn_mask=mask)
    out.backward(grad.float())
    reference = (out.detach(), exact[0].grad)
    del exact, out

    def timed(call):
        def step():
            call().backward(grad)
            q.grad = k.grad = v.grad = None
        return harness.median(harness.time_call(step, device, args.warmup, args.repeats))

    seconds = {name: timed(call) for name, call in calls.items()}
    seconds["mask_build"] = harness.median(harness.time_call(
        lambda: layout_block_mask(layout, args.block, args.length, False, args.length, device), device, 1,
        args.repeats))
    # where sparse's time goes (its 3x goal was missed at 1.8x on an H200): the forward alone,
    # the same layout without its global block (whose row and column visit every tile, one
    # long program per head), and the kernels one step runs
    with torch.no_grad():
        for name in ("sparse", "dense_flash"):
            seconds[f"{name}_forward"] = harness.median(harness.time_call(calls[name], device, args.warmup,
                                                                          args.repeats))
    local = SparseSelfAttention(BigBirdSparsityConfig(args.heads, block=args.block, num_global_blocks=0),
                                max_seq_length=args.length)
    seconds["sparse_without_global"] = timed(lambda: local(q, k, v))
    kept = layout.sum().item() / layout.numel()
    return {"seconds": seconds, "kept_fraction": kept,
            "kept_without_global": local.get_layout(args.length).float().mean().item(),
            "sparse_kernels": kernel_profile(lambda: attention(q, k, v).backward(grad), device),
            "speedup_vs_flash": seconds["dense_flash"] / seconds["sparse"],
            "speedup_vs_masked": seconds["dense_masked"] / seconds["sparse"],
            "output_error": relative_error(outputs["sparse"][0], reference[0]),
            "query_grad_error": relative_error(outputs["sparse"][1], reference[1]),
            "dense_masked_errors": [relative_error(outputs["dense_masked"][i], reference[i]) for i in (0, 1)],
            "path": "flex_attention" if device.type == "cuda" else "block_sparse (CPU)"}


def kernel_profile(step, device: torch.device, top: int = 8) -> list[tuple[str, float, int]]:
    """(kernel, device milliseconds, calls) of the `top` kernels one `step` runs, by their
    device time; [] off CUDA."""
    if device.type != "cuda":
        return []
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as profiled:
        step()
        torch.cuda.synchronize()
    events = sorted(profiled.key_averages(), key=lambda event: event.self_device_time_total, reverse=True)
    return [(event.key[:80], round(event.self_device_time_total / 1e3, 3), event.count) for event in events[:top]]


def block_case(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict:
    from shardwise.models.gpt import Block, GPTConfig
    from shardwise.runtime.compile import compile_blocks

    torch.manual_seed(0)
    config = GPTConfig(block_size=args.seq_len, n_layer=1, n_head=args.block_heads, n_embd=args.hidden, dropout=0.0)
    with torch.device(device):
        blocks = torch.nn.ModuleList([Block(config)]).to(dtype)
    x = torch.randn(args.micro_batch, args.seq_len, args.hidden, device=device, dtype=dtype, requires_grad=True)

    def step():
        blocks[0](x).float().square().mean().backward()
        x.grad = None
        blocks.zero_grad(set_to_none=True)

    eager = harness.median(harness.time_call(step, device, args.warmup, args.repeats))
    started = time.perf_counter()
    compile_blocks(torch.nn.Sequential(blocks))
    step()
    harness.synchronize(device)
    compile_seconds = time.perf_counter() - started
    compiled = harness.median(harness.time_call(step, device, args.warmup, args.repeats))
    return {"seconds": {"eager": eager, "compiled": compiled}, "compile_s": compile_seconds,
            "speedup": eager / compiled}


def fused_cases(args: argparse.Namespace, device: torch.device, deadline: harness.Deadline) -> dict:
    """ops_kernels' cases built on `device` (its tensors follow torch's default device)."""
    ops_kernels.ROWS, ops_kernels.WIDTH = (TOY_ROWS, TOY_WIDTH) if args.toy else (DEVICE_ROWS, DEVICE_WIDTH)
    results: dict[str, dict] = {}
    torch.set_default_device(device)
    try:
        for case in TOY_FUSED_CASES if args.toy else FUSED_CASES:
            if deadline.left() < MIN_SECONDS_PER_CASE:
                results[case] = {"outcome": "timeout", "error": "no time left in the budget"}
                continue
            seconds = {}
            for variant in ops_kernels.VARIANTS[case]:
                step = ops_kernels.build(case, variant)
                seconds[variant] = harness.median(harness.time_call(step, device, args.warmup, args.repeats))
            results[case] = {"outcome": "ok", "seconds": seconds,
                             **{f"{variant}_speedup": seconds["unfused"] / seconds[variant]
                                for variant in seconds if variant != "unfused"}}
            print(f"fused {case}: " + ", ".join(f"{v} {s * 1e3:.2f} ms" for v, s in seconds.items()), flush=True)
    finally:
        torch.set_default_device(None)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_common_arguments(parser)
    for name, value in FULL.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, help=f"(default {value}; toy {TOY[name]})")
    parser.add_argument("--parts", nargs="+", choices=("attention", "block", "fused"),
                        default=["attention", "block", "fused"])
    args = parser.parse_args()
    for name, value in (TOY if args.toy else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    device = harness.pick_device(args.device)
    if (skip := harness.refuse_cpu_at_full_size(device, args.toy, "kernels")) is not None:
        harness.emit(skip, args.json_out)
        return
    deadline = harness.Deadline(args.budget)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    numbers: dict = {"settings": {name: getattr(args, name) for name in FULL}, "dtype": dtype,
                     **harness.environment(device)}
    parts, problems = [], []
    if "attention" in args.parts:
        attention = numbers["attention"] = attention_case(args, device, dtype)
        seconds = attention["seconds"]
        print(f"attention: {attention}", flush=True)
        parts.append(f"sparse {attention['speedup_vs_flash']:.1f}x vs flash, {attention['speedup_vs_masked']:.1f}x vs "
                     f"masked at {args.length} ({attention['kept_fraction']:.0%} kept, mask build "
                     f"{seconds['mask_build'] * 1e3:.1f} ms; forward alone "
                     f"{seconds['dense_flash_forward'] / seconds['sparse_forward']:.1f}x; without the global block "
                     f"{seconds['dense_flash'] / seconds['sparse_without_global']:.1f}x at "
                     f"{attention['kept_without_global']:.0%} kept)")
        worst = max(attention["output_error"], attention["query_grad_error"])
        if worst > BF16_TOLERANCE:
            problems.append(f"sparse differs from fp32 dense masked by {worst:.1e} (bf16 dense masked by "
                            f"{max(attention['dense_masked_errors']):.1e})")
        if not args.toy and attention["speedup_vs_flash"] < SPARSE_GOAL:
            problems.append(f"goal missed: sparse {attention['speedup_vs_flash']:.1f}x < {SPARSE_GOAL:.0f}x vs flash")
    if "block" in args.parts:
        block = numbers["block"] = block_case(args, device, dtype)
        print(f"block: {block}", flush=True)
        parts.append(f"compiled block {block['speedup']:.2f}x eager (compile {block['compile_s']:.0f} s)")
    if "fused" in args.parts:
        fused = numbers["fused"] = fused_cases(args, device, deadline)
        done = {case: result for case, result in fused.items() if result["outcome"] == "ok"}
        parts.append("fused " + (", ".join(f"{case} {result['fused_speedup']:.2f}x" for case, result in done.items()
                                           if "fused_speedup" in result) or "none run")
                     + (f" ({len(fused) - len(done)} not run: budget)" if len(done) < len(fused) else ""))
    status = "FAIL" if problems else "PASS"
    summary = ("; ".join(problems) + ": " if problems else "") + "; ".join(parts)
    goal = (f"sparse equals the fp32 masked attention (< {BF16_TOLERANCE:g}) and is >= {SPARSE_GOAL:.0f}x faster "
            f"than dense flash at {FULL['length']}")
    harness.emit(harness.Result("kernels", status, summary, goal, numbers), args.json_out)
    sys.exit(1 if status == "FAIL" else 0)


if __name__ == "__main__":
    main()
