"""Optimizer steps on the device: LAMB and 8-bit AdamW on their Triton kernels
(shardwise/runtime/optim/triton_kernels.py) against torch's fused AdamW, their own torch
path, and bitsandbytes' and apex's kernels where those import (issue 27 item 1, C17).

The parameters are a GPT's tensors (`--width`, `--layers`: embeddings, four matrices and
four vectors per layer), fp32, gradients random. Per variant: one step first (the state
is created and kernels compile there), then the median of `--repeats` synchronised steps,
as time per element, as a ratio to fused AdamW, and beside the physical limit: the bytes
the step must move (below) divided by the device's copy bandwidth, measured here.

Bytes per element: fused AdamW 28 (weight, both moments read and written, gradient read);
LAMB 40 (pass 1 reads weight, gradient, both moments and writes the moments; pass 2 reads
weight and moments and writes the weight); 8-bit AdamW 16 (weight read and written,
gradient read, two 1-byte codes read and written; the block scales add 1/32).

Correctness first: from the same weights, gradients and state, one step on the Triton
kernels and one on the torch path must agree (relative error of the weights < 1e-5 for
LAMB; < 1e-3 for 8-bit AdamW, where a code may move by one).
Goals (issue 27): LAMB <= 2x fused AdamW; 8-bit AdamW <= 1.5x fused AdamW and no slower
than bitsandbytes' AdamW8bit.

    python3 benchmarks/gpu/optimizers.py --budget 60
    python3 benchmarks/gpu/optimizers.py --toy
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import harness

import torch  # noqa: E402

FULL = {"width": 2048, "layers": 12, "vocab": 32000, "warmup": 2, "repeats": 10}
TOY = {"width": 64, "layers": 2, "vocab": 256, "warmup": 1, "repeats": 2}
BYTES_PER_ELEMENT = {"fused_adamw": 28, "lamb": 40, "adamw8bit": 16}
GOALS = {"lamb": 2.0, "adamw8bit": 1.5}
TOLERANCE = {"lamb": 1e-5, "adamw8bit": 1e-3}


def gpt_shapes(width: int, layers: int, vocab: int) -> list[tuple[int, ...]]:
    """A GPT's parameter shapes: token embedding, per layer attention and MLP matrices,
    their biases and two norms' gains and biases, a final norm."""
    per_layer = [(3 * width, width), (3 * width,), (width, width), (width,), (4 * width, width), (4 * width,),
                 (width, 4 * width), (width,), (width,), (width,), (width,), (width,)]
    return [(vocab, width)] + per_layer * layers + [(width,), (width,)]


def make_params(shapes: list[tuple[int, ...]], device: torch.device) -> list[torch.nn.Parameter]:
    generator = torch.Generator(device=device).manual_seed(0)
    params = []
    for shape in shapes:
        param = torch.nn.Parameter(torch.randn(shape, device=device, generator=generator) * 0.02)
        param.grad = torch.randn(shape, device=device, generator=generator) * 1e-3
        params.append(param)
    return params


def builders() -> dict[str, tuple[str, callable]]:
    """Variant name -> (optimizer family, a function building it on a parameter list); the
    torch path variants turn the Triton kernels off for their steps."""
    from shardwise.runtime.optim.adam8bit import AdamW8bit
    from shardwise.runtime.optim.lamb import Lamb

    variants = {
        "fused_adamw": ("fused_adamw", lambda params: torch.optim.AdamW(params, lr=1e-3, fused=True)),
        "lamb_triton": ("lamb", lambda params: Lamb(params, lr=1e-3, weight_decay=0.01)),
        "lamb_torch": ("lamb", lambda params: Lamb(params, lr=1e-3, weight_decay=0.01)),
        "adamw8bit_triton": ("adamw8bit", lambda params: AdamW8bit(params, lr=1e-3)),
        "adamw8bit_torch": ("adamw8bit", lambda params: AdamW8bit(params, lr=1e-3)),
    }
    try:
        import bitsandbytes

        variants["adamw8bit_bitsandbytes"] = ("adamw8bit", lambda params: bitsandbytes.optim.AdamW8bit(params, lr=1e-3))
    except Exception as error:  # not installed, or no kernels for this device
        print(f"bitsandbytes not measured: {type(error).__name__}: {str(error)[:160]}", flush=True)
    try:
        from apex.optimizers import FusedLAMB

        variants["lamb_apex"] = ("lamb", lambda params: FusedLAMB(params, lr=1e-3, weight_decay=0.01))
    except Exception as error:
        print(f"apex not measured: {type(error).__name__}: {str(error)[:160]}", flush=True)
    return variants


def on_torch_path(name: str) -> bool:
    return name.endswith("_torch")


def step_seconds(name: str, build, shapes, device, args) -> float:
    """Median seconds of one step, the state made by a first step."""
    params = make_params(shapes, device)
    optimizer = build(params)
    os.environ["SHARDWISE_TRITON_OPTIM"] = "0" if on_torch_path(name) else "1"
    try:
        return harness.median(harness.time_call(optimizer.step, device, args.warmup, args.repeats))
    finally:
        os.environ.pop("SHARDWISE_TRITON_OPTIM", None)


def agreement(family: str, build, shapes, device) -> float:
    """Relative error of the weights after one step on the Triton kernels against one on
    the torch path, from the same weights, gradients and state (a first step made it)."""
    params = make_params(shapes, device)
    optimizer = build(params)
    optimizer.step()
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for twin, param in zip(twins, params):
        twin.grad = param.grad.clone()
    twin_optimizer = build(twins)
    twin_optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    os.environ["SHARDWISE_TRITON_OPTIM"] = "1"
    optimizer.step()
    os.environ["SHARDWISE_TRITON_OPTIM"] = "0"
    twin_optimizer.step()
    os.environ.pop("SHARDWISE_TRITON_OPTIM", None)
    mine = torch.cat([p.detach().reshape(-1) for p in params])
    reference = torch.cat([p.detach().reshape(-1) for p in twins])
    return ((mine - reference).norm() / reference.norm()).item()


def copy_bandwidth(device: torch.device, elements: int) -> float:
    """Bytes per second of a device-to-device copy, counting bytes read and written."""
    source = torch.empty(elements, device=device)
    target = torch.empty_like(source)
    seconds = harness.median(harness.time_call(lambda: target.copy_(source), device, 2, 10))
    return 2 * source.numel() * source.element_size() / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_common_arguments(parser)
    for name, value in FULL.items():
        parser.add_argument(f"--{name}", type=int, default=None, help=f"(default {value}; toy {TOY[name]})")
    args = parser.parse_args()
    for name, value in (TOY if args.toy else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    device = harness.pick_device(args.device)
    if (skip := harness.refuse_cpu_at_full_size(device, args.toy, "optim")) is not None:
        harness.emit(skip, args.json_out)
        return
    from shardwise.runtime.optim import triton_gate

    deadline = harness.Deadline(args.budget)
    shapes = gpt_shapes(args.width, args.layers, args.vocab)
    elements = sum(torch.Size(shape).numel() for shape in shapes)
    probe = torch.empty(1, device=device)
    numbers: dict = {"settings": {name: getattr(args, name) for name in FULL}, "elements": elements,
                     "triton_kernels": triton_gate.takes(probe), **harness.environment(device)}
    bandwidth = numbers["copy_bandwidth_bytes_per_s"] = copy_bandwidth(device, min(elements, 2**28))
    print(f"{harness.count(elements)} fp32 elements; copy bandwidth {bandwidth / 1e9:.0f} GB/s; Triton kernels "
          f"{'on' if numbers['triton_kernels'] else 'off (not a GPU, or no Triton)'}", flush=True)
    variants = builders()
    problems = []
    numbers["agreement"] = {}
    for family in ("lamb", "adamw8bit"):
        error = numbers["agreement"][family] = agreement(family, variants[f"{family}_triton"][1], shapes, device)
        if error > TOLERANCE[family]:
            problems.append(f"{family}: Triton kernels differ from the torch path by {error:.1e}")
    numbers["variants"] = {}
    for name, (family, build) in variants.items():
        if deadline.left() < 5.0:
            numbers["variants"][name] = {"outcome": "timeout"}
            continue
        try:
            seconds = step_seconds(name, build, shapes, device, args)
        except Exception as error:
            numbers["variants"][name] = {"outcome": "error", "error": f"{type(error).__name__}: {str(error)[:300]}"}
            print(f"{name}: {numbers['variants'][name]['error']}", flush=True)
            harness.reset_memory(device)
            continue
        limit = BYTES_PER_ELEMENT[family] * elements / bandwidth
        numbers["variants"][name] = {"outcome": "ok", "seconds": seconds, "ns_per_element": seconds / elements * 1e9,
                                     "limit_seconds": limit, "of_limit": seconds / limit}
        print(f"{name}: {seconds * 1e3:.2f} ms per step, {seconds / elements * 1e9:.3f} ns per element, "
              f"{seconds / limit:.2f}x its memory limit", flush=True)
        harness.reset_memory(device)
    timed = {name: result["seconds"] for name, result in numbers["variants"].items() if result["outcome"] == "ok"}
    parts = []
    if "fused_adamw" in timed:
        for name, seconds in timed.items():
            numbers["variants"][name]["vs_fused_adamw"] = seconds / timed["fused_adamw"]
        for family, goal in GOALS.items():
            name = f"{family}_triton"
            if name not in timed:
                continue
            ratio = timed[name] / timed["fused_adamw"]
            parts.append(f"{family} {ratio:.2f}x fused AdamW (torch path "
                         f"{timed.get(f'{family}_torch', float('nan')) / timed['fused_adamw']:.2f}x)")
            if not args.toy and numbers["triton_kernels"] and ratio > goal:
                problems.append(f"goal missed: {family} {ratio:.2f}x > {goal}x fused AdamW")
        if "adamw8bit_bitsandbytes" in timed and "adamw8bit_triton" in timed:
            versus = timed["adamw8bit_triton"] / timed["adamw8bit_bitsandbytes"]
            parts.append(f"adamw8bit {versus:.2f}x bitsandbytes")
            if not args.toy and numbers["triton_kernels"] and versus > 1.0:
                problems.append(f"goal missed: adamw8bit {versus:.2f}x bitsandbytes' AdamW8bit")
        if "lamb_apex" in timed and "lamb_triton" in timed:
            parts.append(f"lamb {timed['lamb_triton'] / timed['lamb_apex']:.2f}x apex FusedLAMB")
    parts.append("agreement " + ", ".join(f"{family} {error:.1e}" for family, error in numbers["agreement"].items()))
    status = "FAIL" if problems else "PASS"
    summary = ("; ".join(problems) + ": " if problems else "") + "; ".join(parts)
    goal = ("Triton kernels agree with the torch path; LAMB <= 2x and 8-bit AdamW <= 1.5x torch's fused AdamW per "
            "step, 8-bit AdamW no slower than bitsandbytes'")
    harness.emit(harness.Result("optim", status, summary, goal, numbers), args.json_out)
    sys.exit(1 if status == "FAIL" else 0)


if __name__ == "__main__":
    main()
