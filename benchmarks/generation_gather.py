"""Generation from a ZeRO-3 policy: gathered once per `generate` call vs by every forward
(issue 31, C32: TRL's GRPO, `gathered_for_generation`).

    .venv/bin/python benchmarks/generation_gather.py            # ≈6M-parameter Llama, 2 ranks, 32 tokens

Each variant runs on fresh rank processes (run_distributed, gloo, one intra-op thread per
rank): a seeded random Llama at stage 3 (every parameter partitioned) greedily generates
`--new-tokens` tokens for `--batch` prompts per rank, `--repeats` times. "once" generates
inside `gathered_for_generation` (what shardwise's TRL trainers do); "per forward" leaves
the gathers to the stage-3 hooks of each forward (what TRL would do on shardwise without
it; `min_new_tokens` keeps the ranks' forward counts equal, which that path needs); the
"stage 2" row is the same generation with whole parameters, the floor. Reported: the
median over repeats of the slowest rank's wall time, the all-gather bytes one rank sent
per generation (`comm_volume()`), and `generation_gather_bytes` from
shardwise/formulas/communication.py.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve()
sys.path.insert(0, str(SCRIPT.parent.parent))
sys.path.insert(0, str(SCRIPT.parent))

from report import machine_line, markdown_table  # noqa: E402

WORLD = 2
VARIANTS = ("stage 2", "once", "per forward")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    return parser.parse_args()


def generate_worker(rank: int, world_size: int, variant: str, options: dict) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    import shardwise
    from shardwise.runtime.zero.gathered import gathered_for_generation

    torch.manual_seed(0)
    hidden = options["hidden"]
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=options["vocab"], hidden_size=hidden, intermediate_size=4 * hidden,
        num_hidden_layers=options["layers"], num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64,
        max_position_embeddings=options["prompt_len"] + options["new_tokens"], tie_word_embeddings=False))
    stage = 2 if variant == "stage 2" else 3
    engine = shardwise.initialize(model, {
        "train_micro_batch_size_per_gpu": options["batch"],
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}})
    engine.eval()
    prompts = torch.randint(0, options["vocab"], (options["batch"], options["prompt_len"]),
                            generator=torch.Generator().manual_seed(rank))
    tokens = options["new_tokens"]
    seconds, gathered = [], []
    for _ in range(options["repeats"]):
        torch.distributed.barrier()
        engine.reset_comm_volume()
        start = time.perf_counter()
        with torch.no_grad(), (gathered_for_generation(model.parameters()) if variant == "once" else nullcontext()):
            model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=tokens,
                           min_new_tokens=tokens, do_sample=False, pad_token_id=0)
        seconds.append(time.perf_counter() - start)
        gathered.append(engine.comm_volume()["all_gather"])
    padded = engine.num_parameters() + engine.padding_elements()
    persistent = engine.persistent_numel() if stage == 3 else 0
    return {"seconds": seconds, "all_gather": gathered, "padded": padded, "persistent": persistent}


def main() -> None:
    from shardwise.formulas.communication import generation_gather_bytes
    from shardwise.tools.testing import run_distributed

    args = parse_args()
    options = vars(args)
    print(machine_line(), flush=True)
    rows = []
    for variant in VARIANTS:
        results = run_distributed(generate_worker, WORLD, variant, options, timeout=1200)
        slowest = [max(result["seconds"][index] for result in results) for index in range(args.repeats)]
        first = results[0]
        gathers = {"stage 2": 0, "once": 1, "per forward": args.new_tokens}[variant]
        formula = generation_gather_bytes(first["padded"], persistent_params=first["persistent"], param_bytes=4,
                                          shard_size=WORLD, gathers=gathers) if gathers else 0
        rows.append([variant, f"{statistics.median(slowest):.3f}", f"{first['all_gather'][0] / 2**20:.2f}",
                     f"{formula / 2**20:.2f}", f"{first['padded'] / 1e6:.2f}M"])
    print(f"\n{args.batch} prompts of {args.prompt_len} tokens per rank, {args.new_tokens} new tokens, "
          f"{WORLD} ranks, fp32\n")
    print(markdown_table(["generation", "s per generate", "all-gather MiB per rank", "formula MiB", "Ψ (padded)"],
                         rows))


if __name__ == "__main__":
    main()
