"""shardwise's 1F1B pipeline beside torch.distributed.pipelining's Schedule1F1B (issue 11).

    .venv/bin/python benchmarks/pipeline.py --deepspeed-python /tmp/dsvenv/bin/python            # pp=2, 2 ranks
    .venv/bin/python benchmarks/pipeline.py --data 2 --deepspeed-python /tmp/dsvenv/bin/python   # pp=2 x dp=2

Both sides train the same untied GPT (shardwise.models, torch pipelining cannot tie a
weight across stages), from the same seed, on the same batches, split after the same
layer, with m micro-batches per step, fp32 and AdamW:

    torch      PipelineStage + Schedule1F1B over the pipeline group; with --data 2 the
               gradients are all-reduced over the data-parallel group after the schedule
    shardwise  shardwise.initialize with pipeline_parallel {size 2, schedule 1f1b} and
               ZeRO stage 1 over the data-parallel group; engine.train_batch

Reported per variant: median step time (the slowest rank's), peak RSS per rank, the final
loss, and for shardwise the measured bubble (idle share of its schedule) beside the
formula (p-1)/(m+p-1).

    deepspeed  DeepSpeed's PipelineModule over [embedding, blocks..., final norm + output
               layer] split uniformly (the same 2 + 2 blocks), its own 1F1B TrainSchedule
               and data parallelism, `engine.train_batch`; run by torchrun under the
               interpreter of a DeepSpeed install (--deepspeed-python, the one
               benchmarks/zero3_vs_fsdp2_deepspeed.py describes), left out if absent.

The machine is shared with other jobs, so timings are noisy: compare within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.models import GPT, GPTConfig
from shardwise.formulas.layers import pipeline_bubble_fraction
from shardwise.tools.testing import run_distributed


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--data", type=int, default=1, help="data-parallel size (world = 2 x data)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--variants", default="torch,shardwise,deepspeed")
    parser.add_argument("--deepspeed-python", default=os.environ.get("DEEPSPEED_PYTHON", "/tmp/ds-venv/bin/python"))
    parser.add_argument("--deepspeed-worker", type=Path, help=argparse.SUPPRESS)  # result directory of a rank
    return parser.parse_args()


def build(args: argparse.Namespace) -> GPT:
    torch.manual_seed(1234)
    config = GPTConfig(vocab_size=256, block_size=args.seq_len, n_layer=args.layers, n_head=args.heads,
                       n_embd=args.width, tie_embeddings=False)
    return GPT(config)


def batches(args: argparse.Namespace, step: int, data_rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(step)
    rows = args.data * args.micro_batches * args.micro_batch
    tokens = torch.randint(0, 256, (rows, args.seq_len + 1), generator=generator)
    out = []
    for i in range(args.micro_batches):
        start = (i * args.data + data_rank) * args.micro_batch
        part = tokens[start:start + args.micro_batch]
        out.append((part[:, :-1], part[:, 1:]))
    return out


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))


class FirstStage(nn.Module):
    def __init__(self, model: GPT, layers: list[int]):
        super().__init__()
        self.wte, self.wpe, self.drop = model.wte, model.wpe, model.drop
        self.blocks = nn.ModuleList(model.blocks[i] for i in layers)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(idx.shape[1])))
        for block in self.blocks:
            x = block(x)
        return x


class LastStage(nn.Module):
    def __init__(self, model: GPT, layers: list[int]):
        super().__init__()
        self.blocks = nn.ModuleList(model.blocks[i] for i in layers)
        self.ln_f, self.lm_head = model.ln_f, model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def run_torch(rank: int, world: int, args: argparse.Namespace) -> dict:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    pipe_rank, data_rank = divmod(rank, args.data)  # pipeline outermost, as shardwise's mesh
    pipe_groups = [dist.new_group([d + p * args.data for p in range(2)]) for d in range(args.data)]
    data_groups = [dist.new_group([d + p * args.data for d in range(args.data)]) for p in range(2)]
    model = build(args)
    half = args.layers // 2
    module = FirstStage(model, list(range(half))) if pipe_rank == 0 else LastStage(model, list(range(half, args.layers)))
    stage = PipelineStage(module, pipe_rank, 2, torch.device("cpu"), group=pipe_groups[data_rank])
    schedule = Schedule1F1B(stage, n_microbatches=args.micro_batches, loss_fn=loss_fn)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
    times, loss = [], float("nan")
    for step in range(args.warmup + args.steps):
        parts = batches(args, step, data_rank)
        x = torch.cat([p[0] for p in parts])
        y = torch.cat([p[1] for p in parts])
        started = time.perf_counter()
        losses: list[torch.Tensor] = []
        if pipe_rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=losses)
        if args.data > 1:
            for param in module.parameters():
                dist.all_reduce(param.grad, group=data_groups[pipe_rank])
                param.grad /= args.data
        optimizer.step()
        optimizer.zero_grad()
        if step >= args.warmup:
            times.append(time.perf_counter() - started)
        if losses:
            loss = torch.stack(losses).mean().item()
    return {"times": times, "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "loss": loss}


def run_shardwise(rank: int, world: int, args: argparse.Namespace) -> dict:
    import shardwise

    model = build(args)
    config = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": args.micro_batches,
              "zero_optimization": {"stage": 1},
              "pipeline_parallel": {"size": 2, "schedule": "1f1b", "partition": "uniform"}}
    engine = shardwise.initialize(model, config, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4))
    times, bubbles, loss = [], [], float("nan")
    for step in range(args.warmup + args.steps):
        parts = batches(args, step, engine.mesh.data_rank)
        started = time.perf_counter()
        loss = engine.train_batch(iter(parts), loss_fn=loss_fn).item()
        if step >= args.warmup:
            times.append(time.perf_counter() - started)
            bubbles.append(engine.pipeline.last_timing["bubble"])
    return {"times": times, "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "loss": loss,
            "bubble": statistics.median(bubbles)}


class Embedding(nn.Module):
    def __init__(self, model: GPT):
        super().__init__()
        self.wte, self.wpe, self.drop = model.wte, model.wpe, model.drop

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.drop(self.wte(idx) + self.wpe(torch.arange(idx.shape[1])))


class Head(nn.Module):
    def __init__(self, model: GPT):
        super().__init__()
        self.ln_f, self.lm_head = model.ln_f, model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


def deepspeed_rank(args: argparse.Namespace) -> None:
    """One torchrun rank of the DeepSpeed variant; writes its result beside the others'."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.pipe import PipelineModule

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    model = build(args)
    net = PipelineModule(layers=[Embedding(model), *model.blocks, Head(model)], loss_fn=loss_fn, num_stages=2,
                         partition_method="uniform")
    config = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": args.micro_batches,
              "steps_per_print": 10_000, "zero_optimization": {"stage": 1}}
    engine, _, _, _ = deepspeed.initialize(model=net, optimizer=torch.optim.AdamW(net.parameters(), lr=1e-4),
                                           config=config)
    data_rank = engine.grid.get_data_parallel_rank()
    times, loss = [], float("nan")
    for step in range(args.warmup + args.steps):
        parts = batches(args, step, data_rank)
        started = time.perf_counter()
        loss = engine.train_batch(iter(parts)).item()
        if step >= args.warmup:
            times.append(time.perf_counter() - started)
    result = {"times": times, "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "loss": loss}
    (args.deepspeed_worker / f"{dist.get_rank()}.json").write_text(json.dumps(result))


def run_deepspeed(args: argparse.Namespace, world: int) -> list[dict] | None:
    """The DeepSpeed variant's per-rank results, or None (said why) when it cannot run."""
    if not Path(args.deepspeed_python).exists():
        print(f"deepspeed left out: no interpreter at {args.deepspeed_python}", file=sys.stderr)
        return None
    with tempfile.TemporaryDirectory(prefix="pipeline-deepspeed-") as directory:
        argv = [f"--{name.replace('_', '-')}={value}" for name, value in vars(args).items()
                if name not in ("variants", "deepspeed_python", "deepspeed_worker")]
        command = [args.deepspeed_python, "-m", "torch.distributed.run", f"--nproc_per_node={world}",
                   "--master_port=29533", str(Path(__file__).resolve()), *argv, "--deepspeed-worker", directory]
        environment = os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parent.parent), "OMP_NUM_THREADS": "1"}
        done = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=1200)
        if done.returncode != 0:
            print(f"deepspeed failed and is left out:\n{done.stderr[-3000:]}", file=sys.stderr)
            return None
        return [json.loads((Path(directory) / f"{rank}.json").read_text()) for rank in range(world)]


def main() -> None:
    args = parse_args()
    if args.deepspeed_worker is not None:
        deepspeed_rank(args)
        return
    world = 2 * args.data
    summary = {}
    for variant in args.variants.split(","):
        if variant == "deepspeed":
            results = run_deepspeed(args, world)
            if results is None:
                continue
        else:
            fn = {"torch": run_torch, "shardwise": run_shardwise}[variant]
            results = run_distributed(fn, world, args, timeout=1200)
        step_times = [max(r["times"][i] for r in results) for i in range(args.steps)]
        summary[variant] = {
            "step_s": round(statistics.median(step_times), 4),
            "load_average_1min": round(os.getloadavg()[0], 2),
            "peak_rss_mib": [round(r["rss_mib"]) for r in results],
            "final_loss": round(max(r["loss"] for r in results if r["loss"] == r["loss"]), 6),
            **({"bubble_measured": [round(r["bubble"], 3) for r in results]} if variant == "shardwise" else {}),
        }
    summary["bubble_theory"] = round(pipeline_bubble_fraction(2, args.micro_batches), 3)
    summary["args"] = vars(args)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
