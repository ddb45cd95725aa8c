"""Hugging Face Mixtral's own MoE with its experts spread over ranks (issue 29, C29):
`expert_parallel.autoep_size` 2 beside every expert on every rank (autoep_size 1).

    .venv/bin/python benchmarks/mixtral_expert_parallel.py      # 2 ranks, 8 experts, top-2

Each variant runs on fresh rank processes (run_distributed, gloo, one intra-op thread per
rank): a seeded random MixtralForCausalLM trains at ZeRO 1 on 2 ranks, each rank its own
batch; with autoep_size 2 each rank keeps 4 of the 8 experts of every layer and tokens go
to their experts and back by the dropless all-to-all (shardwise/models/hf/experts.py).
Reported: the median step time of the slowest rank, tokens per second over the group,
the expert parameters one rank holds, the all-to-all bytes rank 0 sent over all steps
(the engine's count) and `dropless_exchange_bytes` summed over the layer calls with the
counts the routers produced.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve()
sys.path.insert(0, str(SCRIPT.parent.parent))
sys.path.insert(0, str(SCRIPT.parent))

from report import machine_line, markdown_table  # noqa: E402

WORLD = 2


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=512, help="each expert's intermediate width")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    return parser.parse_args()


def train_worker(rank: int, world_size: int, expert_size: int, options: dict) -> dict:
    import transformers

    import shardwise

    torch.set_num_threads(1)
    torch.manual_seed(0)
    experts = options["experts"]
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=options["vocab"], hidden_size=options["hidden"], intermediate_size=options["ffn"],
        num_hidden_layers=options["layers"], num_attention_heads=options["hidden"] // 64, num_key_value_heads=2,
        num_local_experts=experts, num_experts_per_tok=2, max_position_embeddings=options["seq_len"]))
    routed: list[list[int]] = []
    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(lambda _m, _a, output: routed.append(
            torch.bincount(output[2].reshape(-1), minlength=experts).tolist()))
    groups = [{"params": [p for n, p in model.named_parameters() if ".experts." not in n]},
              {"params": [p for n, p in model.named_parameters() if ".experts." in n]}]
    engine = shardwise.initialize(model, {
        "train_micro_batch_size_per_gpu": options["batch"], "zero_optimization": {"stage": 1},
        "expert_parallel": {"enabled": expert_size > 1, "autoep_size": expert_size}},
        optimizer=torch.optim.AdamW(groups, lr=1e-4))
    generator = torch.Generator().manual_seed(100 + rank)
    seconds = []
    for step in range(options["warmup"] + options["steps"]):
        ids = torch.randint(0, options["vocab"], (options["batch"], options["seq_len"]), generator=generator)
        torch.distributed.barrier()
        start = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        if step >= options["warmup"]:
            seconds.append(time.perf_counter() - start)
    held = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    return {"seconds": seconds, "routed": routed, "held": held,
            "all_to_all": engine.comm_stats.by_group().get("expert", {}).get("all_to_all", 0)}


def main() -> None:
    from shardwise.formulas.communication import dropless_exchange_bytes
    from shardwise.tools.testing import run_distributed

    args = parse_args()
    options = vars(args)
    print(machine_line(), flush=True)
    steps = args.warmup + args.steps
    rows = []
    for expert_size in (1, 2):
        results = run_distributed(train_worker, WORLD, expert_size, options, timeout=1200)
        slowest = statistics.median(max(result["seconds"][index] for result in results)
                                    for index in range(args.steps))
        formula = "-"
        if expert_size > 1:
            calls = zip(*(result["routed"] for result in results))
            formula = f"{sum(dropless_exchange_bytes(list(routed), member=0, hidden_size=args.hidden, bytes_per_element=4) for routed in calls):,}"  # noqa: E501
        rows.append([f"autoep_size {expert_size}", f"{slowest:.3f}",
                     f"{WORLD * args.batch * args.seq_len / slowest:,.0f}", f"{results[0]['held'] / 1e6:.2f}M",
                     f"{results[0]['all_to_all']:,}", formula])
    print(f"\nMixtral: {args.layers} layers, hidden {args.hidden}, {args.experts} experts of width {args.ffn}, "
          f"top-2, {args.batch} x {args.seq_len} tokens per rank, {WORLD} ranks, ZeRO 1, fp32, "
          f"{args.warmup} warm-up + {args.steps} timed steps\n")
    print(markdown_table(["experts", "step s (median, slowest rank)", "tokens/s", "expert params per rank",
                          f"all-to-all bytes rank 0 sent in {steps} steps", "formula"], rows))


if __name__ == "__main__":
    main()
