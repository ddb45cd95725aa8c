"""DeepSpeed's ALST loop (Ulysses for Hugging Face models, run by the script) under
shardwise's compatibility package beside DeepSpeed 0.19.8 itself (C14, C26).

    .venv/bin/python benchmarks/alst_llama.py --deepspeed-python /tmp/dsvenv/bin/python

The same script text runs twice under the DeepSpeed install's interpreter, each a
torchrun job of `--world` ranks on CPU/gloo: once with `import deepspeed` answered by
shardwise (`install_alias`, which shadows the installed DeepSpeed), once by DeepSpeed.
The loop is the ALST tutorial's: `register_with_transformers` (sdpa), `initialize(mpu=...)`
at ZeRO `--stage`, `UlyssesSPDataLoaderAdapter`, the shards' losses averaged by token
counts, `backward` and `step` per micro-batch. A random-init Llama built from a config
(same seed on both sides), fp32, AdamW. Printed: median step time per side (the slowest
rank's), their ratio, and the largest loss difference over the steps (both sides train
the same sequences from the same weights).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=2048, help="whole sequence (each rank holds 1/S)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--deepspeed-python", default=os.environ.get("DEEPSPEED_PYTHON", "/tmp/dsvenv/bin/python"))
    parser.add_argument("--side", choices=("shardwise", "deepspeed"), help=argparse.SUPPRESS)
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args()


def worker(args: argparse.Namespace) -> None:
    if args.side == "shardwise":
        from shardwise.frontends.deepspeed.alias import install_alias

        install_alias()
    import deepspeed
    import torch.distributed as dist
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
    from deepspeed.runtime.utils import move_to_device
    from deepspeed.utils import groups
    from transformers import LlamaConfig, LlamaForCausalLM

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq_len, attn_implementation="sdpa"))
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=world,
        micro_batch_size=1, seq_length=args.seq_len, seq_length_is_variable=True)
    config = {"train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": world,
              "zero_optimization": {"stage": args.stage}, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "eps": 1e-4, "weight_decay": 0.0}}}
    engine, _, _, _ = deepspeed.initialize(config=config, model=model, model_parameters=model.parameters(), mpu=mpu)
    sp_group = groups._get_sequence_parallel_group()
    generator = torch.Generator().manual_seed(1 + rank)
    per_rank = (args.warmup + args.steps + world - 1) // world
    rows = [{"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(args.seq_len)}
            for ids in torch.randint(0, args.vocab, (per_rank, args.seq_len), generator=generator)]
    loader = UlyssesSPDataLoaderAdapter(
        torch.utils.data.DataLoader(rows, batch_size=1), sp_rank=groups._get_sequence_parallel_rank(),
        sp_group=sp_group, sp_world_size=groups._get_sequence_parallel_world_size(), device=engine.device)
    times, losses = [], []
    for index, batch in zip(range(args.warmup + args.steps), loader):
        dist.barrier()
        started = time.perf_counter()
        batch = move_to_device(batch, engine.device)
        outputs = engine(**batch)
        shift_labels = batch["shift_labels"]
        loss = engine.module.loss_function(logits=outputs.logits, labels=None, shift_labels=shift_labels,
                                           vocab_size=engine.module.config.vocab_size)
        losses_per_rank = torch.distributed.nn.functional.all_gather(loss, group=sp_group)
        good = (shift_labels != -100).view(-1).sum()
        good_per_rank = torch.distributed.nn.functional.all_gather(good, group=sp_group)
        loss = sum(losses_per_rank[r] * good_per_rank[r] for r in range(world)) / max(sum(good_per_rank), 1)
        engine.backward(loss)
        engine.step()
        if index >= args.warmup:
            times.append(time.perf_counter() - started)
        losses.append(loss.item())
    (args.worker / f"{args.side}.{rank}.json").write_text(json.dumps({"times": times, "losses": losses}))


def run_side(args: argparse.Namespace, side: str, directory: str, port: int) -> list[dict]:
    argv = [f"--{name.replace('_', '-')}={value}" for name, value in vars(args).items()
            if name not in ("deepspeed_python", "worker", "side")]
    command = [args.deepspeed_python, "-m", "torch.distributed.run", f"--nproc_per_node={args.world}",
               f"--master_port={port}", str(Path(__file__).resolve()), *argv, "--side", side, "--worker", directory]
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        sys.exit(f"the {side} torchrun job failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return [json.loads((Path(directory) / f"{side}.{rank}.json").read_text()) for rank in range(args.world)]


def main() -> None:
    args = parse_args()
    if args.worker is not None:
        worker(args)
        return
    if not Path(args.deepspeed_python).exists():
        sys.exit(f"no DeepSpeed interpreter at {args.deepspeed_python}: pass --deepspeed-python")
    summary = {}
    with tempfile.TemporaryDirectory(prefix="alst-llama-") as directory:
        results = {side: run_side(args, side, directory, port)
                   for side, port in (("shardwise", 29561), ("deepspeed", 29562))}
    for side, ranks in results.items():
        per_step = [max(rank["times"][i] for rank in ranks) for i in range(args.steps)]
        summary[f"{side}_step_s"] = round(statistics.median(per_step), 4)
    summary["shardwise_over_deepspeed"] = round(summary["shardwise_step_s"] / summary["deepspeed_step_s"], 3)
    ours, theirs = results["shardwise"][0]["losses"], results["deepspeed"][0]["losses"]
    summary["losses_shardwise"] = [round(value, 6) for value in ours]
    summary["losses_deepspeed"] = [round(value, 6) for value in theirs]
    summary["max_loss_difference"] = max(abs(a - b) for a, b in zip(ours, theirs))
    summary["load_average_1min"] = round(os.getloadavg()[0], 2)
    summary["args"] = {key: value for key, value in vars(args).items() if key not in ("worker", "side")}
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
