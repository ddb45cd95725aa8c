"""shardwise ZeRO-3 beside torch FSDP2 (`fully_shard`) and DeepSpeed ZeRO-3 (issue 3, C4).

    .venv/bin/python benchmarks/zero3_vs_fsdp2_deepspeed.py     # ≈25M and ≈100M GPTs, 2 ranks

Each model size runs the three frameworks one after the other, each on fresh rank
processes (peak RSS is a per-process high-water mark), from the same initial weights
(the same seeded construction), on the same batches, in fp32. All three train with the
same optimizer object type and settings (torch's fused AdamW, given to each framework as
an instance) and clip at the same global norm; shardwise and DeepSpeed read the very same
DeepSpeed config dict.

DeepSpeed runs under its own interpreter (it pins packages of its own), by default the
virtual env at /tmp/ds-venv, created with:

    python3.11 -m venv /tmp/ds-venv
    echo torch==2.13.0 > /tmp/ds-constraints.txt
    /tmp/ds-venv/bin/pip install -c /tmp/ds-constraints.txt torch==2.13.0
    DS_BUILD_OPS=0 /tmp/ds-venv/bin/pip install -c /tmp/ds-constraints.txt deepspeed

With `--offload-optimizer cpu|nvme` shardwise and DeepSpeed run ZeRO-Offload / ZeRO-Infinity
from the same config (FSDP2 has no counterpart and is left out).

A fourth variant, `floor`, is the same per-rank work with no communication at all: one
process per rank, all running at once, no process group. Each builds the whole GPT, runs
forward and backward on its micro-batch, copies its 1/N chunk of the gradients into a
flat shard (what the reduce-scatter's output holds), clips that shard at the same norm and
steps torch's fused AdamW on a flat 1/N shard of the parameters. Every framework's step
time is printed as a multiple of it. Beside it, the floor's own lower bound for moving
the bytes: shardwise's counted bytes sent per rank per step divided by the loopback
bandwidth of a point-to-point exchange between the ranks, measured in the same run.

`--variants shardwise,shardwise-tcp,...` adds shardwise with its shared-memory transport
off (`SHARDWISE_SHARED_MEMORY=0`: the ranks' bytes go over gloo's TCP loopback), so the
transport's gain is measured within one run.

Targets: step time ≤ 1.0× FSDP2 and ≤ 0.7× DeepSpeed (issue 3), ≤ 0.65× FSDP2 and ≤ 1.25×
the floor (issue 27); per-rank peak RSS lower than both; fp32 losses equal to
DeepSpeed's to 1e-5 (relative).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

import torch

SCRIPT = Path(__file__).resolve()
sys.path.insert(0, str(SCRIPT.parent))

from launch import run_ranks, run_rounds  # noqa: E402
from report import (  # noqa: E402
    VariantSummary,
    comm_text,
    loss_difference,
    machine_line,
    markdown_table,
    mib,
    verdict,
)

VARIANTS = ("shardwise", "fsdp2", "deepspeed", "floor")  # the default run
TCP_VARIANT = "shardwise-tcp"  # shardwise without its shared-memory transport
BANDWIDTH_BYTES = 64 * 1024 * 1024  # each rank's message in the loopback measurement
BANDWIDTH_REPEATS = 5
DEFAULT_DEEPSPEED_PYTHON = "/tmp/ds-venv/bin/python"
REDUCE_BUCKET_ELEMENTS = 25 * 1024 * 1024 // 4  # 25 MiB of fp32, DDP's default bucket
LOSS_TOLERANCE = 1e-5
STATE_KEYS = ("params", "grads", "optimizer_states", "buffers")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="25m,100m", help="GPTConfig presets, comma-separated")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per rank per step")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (median reported)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="repeat the frameworks in turn; step time is the median round")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--clip", type=float, default=1.0, help="gradient clipping norm, all frameworks")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--max-reuse-distance", type=int, default=1_000_000_000,
                        help="stage3_max_reuse_distance for shardwise and DeepSpeed (default: DeepSpeed's "
                        "1e9, which keeps a small model gathered from forward to backward; 0 re-gathers "
                        "in backward, as FSDP2's reshard_after_forward does)")
    parser.add_argument("--gather-per-block", action="store_true",
                        help="shardwise and DeepSpeed gather each transformer block whole (zero_optimization."
                             "leaf_module classes [\"Block\"]), the unit FSDP2's per-block fully_shard has; "
                             "default: DeepSpeed's per-module gathering")
    parser.add_argument("--offload-optimizer", choices=("none", "cpu", "nvme"), default="none",
                        help="offload_optimizer.device for shardwise and DeepSpeed (ZeRO-Offload / ZeRO-Infinity); "
                        "FSDP2 has no equivalent and is left out when set")
    parser.add_argument("--nvme-path", default="runs/nvme_bench", help="offload_optimizer.nvme_path with nvme")
    parser.add_argument("--lora-rank", type=int, default=0,
                        help="> 0: PEFT LoRA adapters of this rank on the blocks' linear layers, the rest frozen "
                        "(every framework partitions the frozen weights too)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated, of {', '.join((*VARIANTS, TCP_VARIANT))}")
    parser.add_argument("--deepspeed-python", default=os.environ.get("DEEPSPEED_PYTHON", DEFAULT_DEEPSPEED_PYTHON),
                        help="interpreter with deepspeed installed (default: $DEEPSPEED_PYTHON or %(default)s)")
    parser.add_argument("--timeout", type=float, default=400, help="seconds per framework run")
    parser.add_argument("--json", type=Path, help="also write the raw per-rank results here")
    parser.add_argument("--worker", choices=(*VARIANTS, TCP_VARIANT, "loopback"), help=argparse.SUPPRESS)
    parser.add_argument("--preset", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# -- inside a rank -------------------------------------------------------------------------
def adamw(model: torch.nn.Module, args: argparse.Namespace) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        [param for param in model.parameters() if param.requires_grad], lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
        weight_decay=0.1, fused=True
    )


def zero3_config(args: argparse.Namespace, world_size: int) -> dict[str, Any]:
    """The DeepSpeed config both shardwise and DeepSpeed read; stage-3 sizes are
    DeepSpeed's defaults except the reduce bucket (25 MiB, as DDP and the ZeRO-1/2 run);
    with --offload-optimizer, both offload the optimizer the same way."""
    config = {
        "train_batch_size": args.micro_batch * world_size,
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": args.clip,
        "steps_per_print": 1_000_000,
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "reduce_bucket_size": REDUCE_BUCKET_ELEMENTS,
            "stage3_prefetch_bucket_size": 50_000_000,
            "stage3_param_persistence_threshold": 100_000,
            "stage3_max_live_parameters": 1_000_000_000,
            "stage3_max_reuse_distance": args.max_reuse_distance,
        },
    }
    if args.gather_per_block:  # one stage-3 unit per GPT Block: its hooks and collectives once per block
        config["zero_optimization"]["leaf_module"] = {"classes": ["Block"]}
    if args.offload_optimizer != "none":  # DeepSpeed then takes the client AdamW instead of its CPU Adam
        config["zero_optimization"]["offload_optimizer"] = {"device": args.offload_optimizer,
                                                            "nvme_path": args.nvme_path, "pin_memory": False}
        config["zero_force_ds_cpu_optimizer"] = False
    return config


def train_shardwise(args: argparse.Namespace, rank: int, world_size: int) -> dict[str, Any]:
    import shardwise

    from workload import ByteBatches, build_gpt, engine_step, rss_bytes, timed_steps

    baseline = rss_bytes()
    model = build_gpt(args.preset, args.seed, args.lora_rank)
    engine = shardwise.initialize(model, zero3_config(args, world_size), optimizer=adamw(model, args))
    batches = ByteBatches(args.seed, world_size, args.micro_batch, args.seq_len)
    record = timed_steps(engine_step(engine), batches, rank, args.warmup, args.steps)
    total_steps = args.warmup + args.steps
    result = {
        "model_state": engine.memory_breakdown(),
        "comm_per_step": {op: v // total_steps for op, v in engine.comm_volume().items() if v},
        "comm_wait_s_per_step": engine.comm.wait_seconds / total_steps,
        "record": record,
        "baseline_rss": baseline,
    }
    engine.destroy()
    return result


def train_fsdp2(args: argparse.Namespace, rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from workload import ByteBatches, TorchLoopStep, build_gpt, local_bytes, optimizer_state_bytes, rss_bytes, timed_steps

    baseline = rss_bytes()
    model = build_gpt(args.preset, args.seed, args.lora_rank)
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    train_step = TorchLoopStep(model, model, adamw(model, args), args.clip)
    batches = ByteBatches(args.seed, world_size, args.micro_batch, args.seq_len)
    record = timed_steps(train_step, batches, rank, args.warmup, args.steps)
    return {
        "model_state": {
            "params": local_bytes(model.parameters()),
            "grads": train_step.grad_bytes,
            "optimizer_states": optimizer_state_bytes(train_step.optimizer),
            "buffers": 0,
        },
        "comm_per_step": {},
        "record": record,
        "baseline_rss": baseline,
    }


def train_deepspeed(args: argparse.Namespace, rank: int, world_size: int) -> dict[str, Any]:
    import deepspeed

    from workload import ByteBatches, build_gpt, engine_step, local_bytes, optimizer_state_bytes, rss_bytes, timed_steps

    baseline = rss_bytes()
    deepspeed.init_distributed(dist_backend="gloo")
    model = build_gpt(args.preset, args.seed, args.lora_rank)
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=adamw(model, args), config=zero3_config(args, world_size)
    )
    batches = ByteBatches(args.seed, world_size, args.micro_batch, args.seq_len)
    record = timed_steps(engine_step(engine), batches, rank, args.warmup, args.steps)
    zero = engine.optimizer
    persistent = [p for p in model.parameters() if getattr(p, "ds_persist", False)]
    frozen = [p.ds_tensor for p in model.parameters() if not p.requires_grad and not getattr(p, "ds_persist", False)]
    master_is_param = all(
        master.data_ptr() == flat.data_ptr()
        for master, flat in zip(zero.fp32_partitioned_groups_flat, zero.fp16_partitioned_groups_flat)
    )
    result = {
        "model_state": {
            "params": local_bytes(zero.fp16_partitioned_groups_flat) + local_bytes(p.data for p in persistent)
            + local_bytes(frozen),
            "grads": local_bytes([zero.grad_partitions_flat_buffer]),
            "optimizer_states": optimizer_state_bytes(zero.optimizer)
            + (0 if master_is_param else local_bytes(zero.fp32_partitioned_groups_flat)),
            "buffers": local_bytes(b.buffer for b in zero.ipg_buckets.values() if b.buffer is not None),
        },
        "comm_per_step": {},
        "record": record,
        "baseline_rss": baseline,
    }
    engine.destroy()
    return result


class FloorStep:
    """A ZeRO-3 rank's work without its communication: the whole model computes forward
    and backward, then the rank's 1/N of the gradients (copied into a flat shard, where a
    reduce-scatter leaves them) is clipped and fused AdamW updates a flat 1/N shard of the
    parameters. The model's weights stay as built (no all-gather brings the update back)."""

    def __init__(self, model: torch.nn.Module, args: argparse.Namespace, rank: int, world_size: int):
        self.model, self.clip, self.rank = model, args.clip, rank
        self.params = [param for param in model.parameters() if param.requires_grad]
        total = sum(param.numel() for param in self.params)
        self.shard_numel = -(-total // world_size)
        self.shard = torch.nn.Parameter(torch.zeros(self.shard_numel))
        self.shard.grad = torch.zeros(self.shard_numel)
        self.optimizer = torch.optim.AdamW([self.shard], lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                                           weight_decay=0.1, fused=True)

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = self.model(inputs, targets)
        loss.backward()
        self._take_owned_gradients()
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_([self.shard], self.clip)
        self.optimizer.step()
        self.model.zero_grad(set_to_none=False)
        return loss.detach()

    def _take_owned_gradients(self) -> None:
        """Copy this rank's contiguous 1/N of the flattened gradients into the shard."""
        low, high = self.rank * self.shard_numel, (self.rank + 1) * self.shard_numel
        offset = 0
        for param in self.params:
            start, stop = max(low, offset), min(high, offset + param.numel())
            if start < stop:
                self.shard.grad[start - low : stop - low].copy_(param.grad.reshape(-1)[start - offset : stop - offset])
            offset += param.numel()


def train_floor(args: argparse.Namespace, rank: int, world_size: int) -> dict[str, Any]:
    from workload import ByteBatches, build_gpt, optimizer_state_bytes, rss_bytes, timed_steps

    baseline = rss_bytes()
    model = build_gpt(args.preset, args.seed, args.lora_rank)
    floor_step = FloorStep(model, args, rank, world_size)
    batches = ByteBatches(args.seed, world_size, args.micro_batch, args.seq_len)
    record = timed_steps(floor_step, batches, rank, args.warmup, args.steps, barrier=store_barrier(rank, world_size))
    return {
        "model_state": {"params": 4 * (sum(p.numel() for p in model.parameters()) + floor_step.shard_numel),
                        "grads": 4 * (sum(p.numel() for p in floor_step.params) + floor_step.shard_numel),
                        "optimizer_states": optimizer_state_bytes(floor_step.optimizer), "buffers": 0},
        "comm_per_step": {},
        "record": record,
        "baseline_rss": baseline,
    }


def store_barrier(rank: int, world_size: int) -> Callable[[], None]:
    """Start every floor step on all ranks together through the launcher's file store:
    no process group, and nothing inside the timed region."""
    from launch import STORE_VARIABLE

    store = torch.distributed.FileStore(os.environ[STORE_VARIABLE], world_size)
    calls = 0

    def barrier() -> None:
        nonlocal calls
        calls += 1
        if store.add(f"arrived {calls}", 1) == world_size:
            store.set(f"go {calls}", "1")
        store.wait([f"go {calls}"])

    return barrier


def measure_loopback(args: argparse.Namespace, rank: int, world_size: int) -> dict[str, Any]:
    """Bytes per second one rank sends while every rank exchanges `BANDWIDTH_BYTES` with
    every other at once (the point-to-point messages shardwise's gathers and
    reduce-scatters are made of): the median of a few exchanges."""
    import statistics
    import time

    import torch.distributed as dist

    message = torch.ones(BANDWIDTH_BYTES // 4)
    received = {peer: torch.empty_like(message) for peer in range(world_size) if peer != rank}
    seconds = []
    for repeat in range(BANDWIDTH_REPEATS + 1):
        operations = []
        for peer, buffer in received.items():
            operations += [dist.P2POp(dist.isend, message, peer), dist.P2POp(dist.irecv, buffer, peer)]
        dist.barrier()
        started = time.perf_counter()
        for work in dist.batch_isend_irecv(operations):
            work.wait()
        if repeat:
            seconds.append(time.perf_counter() - started)
    sent = BANDWIDTH_BYTES * (world_size - 1)
    return {"bytes_per_s": sent / statistics.median(seconds)}


TRAINERS = {"shardwise": train_shardwise, TCP_VARIANT: train_shardwise, "fsdp2": train_fsdp2,
            "deepspeed": train_deepspeed, "floor": train_floor}


def worker(args: argparse.Namespace) -> None:
    from workload import init_process_group, rank_result, write_result

    if args.worker == "floor":
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        torch.set_num_threads(1)
        measured = train_floor(args, rank, world_size)
        record, baseline = measured.pop("record"), measured.pop("baseline_rss")
        write_result(rank, rank_result("floor", record, baseline, **measured))
        return
    if args.worker == TCP_VARIANT:
        os.environ["SHARDWISE_SHARED_MEMORY"] = "0"  # shardwise/runtime/distributed/shared_memory.py
    rank, world_size = init_process_group()
    if args.worker == "loopback":
        write_result(rank, measure_loopback(args, rank, world_size))
        torch.distributed.destroy_process_group()
        return
    measured = TRAINERS[args.worker](args, rank, world_size)
    record, baseline = measured.pop("record"), measured.pop("baseline_rss")
    write_result(rank, rank_result(args.worker, record, baseline, **measured))
    torch.distributed.destroy_process_group()


# -- the parent ----------------------------------------------------------------------------
def worker_argv(args: argparse.Namespace, preset: str, variant: str) -> list[str]:
    argv = ["--worker", variant, "--preset", preset]
    for key in ("micro_batch", "seq_len", "warmup", "steps", "lr", "clip", "seed", "max_reuse_distance",
                "offload_optimizer", "nvme_path", "lora_rank"):
        argv += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    if args.gather_per_block:
        argv.append("--gather-per-block")
    return argv


def chosen_variants(args: argparse.Namespace) -> list[str]:
    variants = args.variants.split(",")
    if "deepspeed" in variants and not Path(args.deepspeed_python).exists():
        print(
            f"DeepSpeed skipped: no interpreter at {args.deepspeed_python} (see this script's "
            "docstring for the install commands, or pass --deepspeed-python)",
            flush=True,
        )
        variants.remove("deepspeed")
    if args.offload_optimizer != "none" and "fsdp2" in variants:
        print("FSDP2 left out: it has no optimizer offload to compare with", flush=True)
        variants.remove("fsdp2")
    return variants


def print_report(args: argparse.Namespace, preset: str, results: dict[str, VariantSummary],
                 loopback_bytes_per_s: float | None) -> None:
    ours = results.get("shardwise")
    floor = results.get("floor")
    print()
    print(f"### GPT preset {preset}")
    print(machine_line())
    rows = []
    for name, summary in results.items():
        state = summary.extra["model_state"]
        loss = "-"
        if ours and name not in ("shardwise", "floor"):  # the floor's weights never change
            absolute, relative = loss_difference(ours.losses, summary.losses)
            loss = f"{absolute:.1e} / {relative:.1e}"
        rows.append([
            name,
            f"{summary.step_s:.3f}",
            f"{ours.step_s / summary.step_s:.3f}" if ours else "-",
            f"{summary.cpu_s:.3f}",
            f"{ours.cpu_s / summary.cpu_s:.3f}" if ours else "-",
            f"{summary.step_s / floor.step_s:.3f}" if floor else "-",
            f"{summary.minor_faults:,.0f}",
            " / ".join(mib(rss) for rss in summary.peak_rss),
            " / ".join(mib(rss - base) for rss, base in zip(summary.peak_rss, summary.baseline_rss)),
            " / ".join(mib(state[key]) for key in STATE_KEYS),
            comm_text(summary.extra["comm_per_step"]),
            f"{summary.extra['comm_wait_s_per_step']:.3f}" if "comm_wait_s_per_step" in summary.extra else "-",
            loss,
            f"{summary.load_at_start:.2f}",
        ])
    print(markdown_table(
        ["framework", "step s (median)", "shardwise / this", "CPU s per step", "shardwise CPU / this",
         "this / floor", "minor page faults per step", "peak RSS MiB (rank 0 / 1)",
         "peak RSS - baseline MiB", "model state MiB (params / grads / optim / buffers)",
         "comm MiB per step", "blocked on comm s per step", "shardwise loss diff (max abs / rel)", "load"],
        rows,
    ))
    if ours and floor and loopback_bytes_per_s:
        sent = sum(value for op, value in ours.extra["comm_per_step"].items() if op != "control")
        moving = sent / loopback_bytes_per_s
        print(f"moving the bytes: shardwise sends {mib(sent)} MiB per rank per step (and receives as much); "
              f"loopback point-to-point {loopback_bytes_per_s / 1e9:.2f} GB/s per rank, measured now -> "
              f"{moving:.3f} s per step on the wire, {moving / floor.step_s:.3f}x the floor's step; "
              f"floor + wire, nothing overlapped: {(floor.step_s + moving) / floor.step_s:.3f}x the floor")
    if ours:
        print_targets(ours, results)


def print_targets(ours: VariantSummary, results: dict[str, VariantSummary]) -> None:
    limits = {"fsdp2": (1.0, 0.65), "deepspeed": (0.7,), "floor": (1.25,)}
    for name, bounds in limits.items():
        if name not in results:
            continue
        other = results[name]
        ratio, cpu_ratio = ours.step_s / other.step_s, ours.cpu_s / other.cpu_s
        for limit in bounds:
            print(f"target step time <= {limit:.2f}x {name}: {ratio:.3f}x -> {verdict(ratio <= limit)} "
                  f"(CPU s per step: {cpu_ratio:.3f}x -> {verdict(cpu_ratio <= limit)}; on a loaded machine the "
                  "CPU time is the steadier of the two)")
        if name == "floor":
            continue
        lower = all(a < b for a, b in zip(ours.peak_rss, other.peak_rss))
        difference = " / ".join(mib(b - a) for a, b in zip(ours.peak_rss, other.peak_rss))
        print(f"target peak RSS below {name}'s on every rank: {name} - shardwise = {difference} MiB "
              f"-> {verdict(lower)}")
    if "deepspeed" in results:
        _, relative = loss_difference(ours.losses, results["deepspeed"].losses)
        print(f"target fp32 losses equal to DeepSpeed's to {LOSS_TOLERANCE:g} (relative): {relative:.1e} "
              f"-> {verdict(relative <= LOSS_TOLERANCE)}")


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    print(machine_line(), flush=True)
    variants = chosen_variants(args)
    print(
        f"settings: {args.world_size} ranks, fp32, seq {args.seq_len}, micro-batch {args.micro_batch} per rank, "
        f"torch fused AdamW (lr {args.lr}, betas 0.9/0.95, wd 0.1) in every framework, clip {args.clip}; "
        f"FSDP2: fully_shard per block + root; shardwise and DeepSpeed: one config, overlap_comm true, "
        f"reduce_bucket_size {REDUCE_BUCKET_ELEMENTS:,}, stage3_max_reuse_distance {args.max_reuse_distance:g}, "
        f"{'each GPT Block gathered whole (leaf_module), ' if args.gather_per_block else ''}"
        f"other stage-3 sizes DeepSpeed's defaults; "
        f"{args.warmup} warm-up + {args.steps} timed steps x {args.rounds} round(s)",
        flush=True,
    )
    raw: dict[str, Any] = {}
    for preset in args.presets.split(","):
        results, raw[preset] = run_rounds(
            SCRIPT, variants, lambda name: worker_argv(args, preset, name), args.world_size,
            args.timeout, args.rounds,
            python_for=lambda name: args.deepspeed_python if name == "deepspeed" else sys.executable,
            env={"DS_ACCELERATOR": "cpu"},
            optional=frozenset({"deepspeed"}),
        )
        loopback = None
        if "floor" in variants and args.world_size > 1:
            ranks = run_ranks(SCRIPT, ["--worker", "loopback"], args.world_size, args.timeout)
            loopback = min(rank["bytes_per_s"] for rank in ranks)
            raw[preset]["loopback_bytes_per_s"] = loopback
        print_report(args, preset, results, loopback)
    print(f"\nload average at the end: {', '.join(f'{v:.2f}' for v in os.getloadavg())}")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "results": raw}, indent=1))


if __name__ == "__main__":
    main()
