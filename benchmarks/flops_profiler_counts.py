"""The flops profiler beside DeepSpeed's (C26): what each counts on a small GPT-2 and Llama.

    .venv/bin/python benchmarks/flops_profiler_counts.py --deepspeed-python /tmp/dsvenv/bin/python

Both profilers profile one forward of the same models (Hugging Face GPT-2 and Llama built
from small configs, random weights from one seed, eval mode, a batch of 2 x 32 tokens, CPU)
with each attention implementation (sdpa, eager): shardwise's in this interpreter,
DeepSpeed 0.19.8's under `--deepspeed-python` (`DS_ACCELERATOR=cpu`). Printed: the total
MACs, parameters and FLOPs of each, the modules whose MACs differ (none expected), the
FLOPs DeepSpeed adds per module type, and the median profiled forward latency over
`--repeats` profiles after one untimed (the model's forward as the module hooks measure it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

MODELS = ("gpt2", "llama")
ATTENTIONS = ("sdpa", "eager")


def profile(flavour: str, repeats: int) -> dict:
    """{model-attention: totals, per-module (flops, macs), median latency} with one profiler."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    if flavour == "deepspeed":
        from deepspeed.profiling.flops_profiler import FlopsProfiler
    else:
        from shardwise.frontends.deepspeed.api.profiling.flops_profiler import FlopsProfiler
    builders = {
        "gpt2": lambda: GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64)),
        "llama": lambda: LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256)),
    }
    results = {}
    for attention in ATTENTIONS:
        for name in MODELS:
            torch.manual_seed(0)
            model = builders[name]()
            model.config._attn_implementation = attention
            model.eval()
            ids = torch.randint(0, 256, (2, 32))
            with torch.no_grad():
                model(ids)  # warm-up
            latencies = []
            for repeat in range(repeats + 1):  # the first profile warms up, untimed
                profiler = FlopsProfiler(model)
                profiler.start_profile()
                with torch.no_grad():
                    model(ids)
                if repeat:
                    latencies.append(profiler.get_total_duration())
                modules = {n: [m.__flops__, m.__macs__, type(m).__name__] for n, m in model.named_modules()}
                totals = [profiler.get_total_flops(), profiler.get_total_macs(), profiler.get_total_params()]
                profiler.end_profile()
            results[f"{name}-{attention}"] = {"totals": totals, "modules": modules,
                                              "latency": statistics.median(latencies)}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deepspeed-python", required=True, help="an interpreter with DeepSpeed 0.19.8")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--side", choices=("shardwise", "deepspeed"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side is not None:
        print(json.dumps(profile(args.side, args.repeats)))
        return
    ours = profile("shardwise", args.repeats)
    ran = subprocess.run([args.deepspeed_python, __file__, "--deepspeed-python", args.deepspeed_python, "--side",
                          "deepspeed", "--repeats", str(args.repeats)], capture_output=True, text=True, check=True,
                         env={**os.environ, "DS_ACCELERATOR": "cpu"})
    theirs = json.loads(ran.stdout.strip().splitlines()[-1])
    print("| model, attention | MACs, shardwise / DeepSpeed | params, shardwise / DeepSpeed | FLOPs, shardwise / "
          "DeepSpeed | modules whose MACs differ | DeepSpeed's extra FLOPs by module type | profiled forward, "
          "shardwise / DeepSpeed |")
    print("|---|---|---|---|---|---|---|")
    for key in ours:
        (flops, macs, params), (their_flops, their_macs, their_params) = ours[key]["totals"], theirs[key]["totals"]
        differing = [n for n in ours[key]["modules"] if ours[key]["modules"][n][1] != theirs[key]["modules"][n][1]]
        extra: dict[str, int] = {}
        for name, (their_module_flops, _, kind) in theirs[key]["modules"].items():
            more = their_module_flops - ours[key]["modules"][name][0]
            if more:
                extra[kind] = extra.get(kind, 0) + more
        print(f"| {key} | {macs:,} / {their_macs:,} | {params:,} / {their_params:,} | {flops:,} / {their_flops:,} | "
              f"{len(differing)} | {', '.join(f'{kind} {more:,}' for kind, more in sorted(extra.items()))} | "
              f"{ours[key]['latency'] * 1e3:.2f} ms / {theirs[key]['latency'] * 1e3:.2f} ms |")


if __name__ == "__main__":
    sys.exit(main())
