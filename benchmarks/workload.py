"""What every benchmark rank shares: process group, model, data, timing loop, measurements.

All variants of a benchmark call these with the same arguments, so they train the same
model from the same initial weights on the same batches; only the framework differs.
"""

from __future__ import annotations

import json
import os
import resource
import sysconfig
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from launch import RESULT_DIR_VARIABLE, STORE_VARIABLE
from shardwise.models import GPT, GPTConfig

CORPUS_BYTES = 4_000_000
COLLECTIVE_TIMEOUT = timedelta(seconds=300)


def init_process_group() -> tuple[int, int]:
    """Join the gloo group of the ranks `launch.run_ranks` started; returns (rank, world)."""
    torch.set_num_threads(1)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        "gloo",
        init_method=f"file://{os.environ[STORE_VARIABLE]}",
        rank=rank,
        world_size=world_size,
        timeout=COLLECTIVE_TIMEOUT,
    )
    return rank, world_size


def build_gpt(preset: str, seed: int, lora_rank: int = 0) -> GPT:
    """The same initial weights in every variant and on every rank. `lora_rank` > 0:
    PEFT's LoRA adapters (that rank) on every linear layer of the blocks, and everything
    else frozen, as a LoRA fine-tuning run has it."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig.preset(preset))
    if lora_rank:
        from peft import LoraConfig, inject_adapter_in_model

        targets = sorted({name.rsplit(".", 1)[-1] for name, module in model.blocks.named_modules()
                          if isinstance(module, torch.nn.Linear)})
        torch.manual_seed(seed + 1)
        model = inject_adapter_in_model(LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, target_modules=targets,
                                                   init_lora_weights="gaussian"), model)
        for name, param in model.named_parameters():
            param.requires_grad = "lora_" in name
    return model


class ByteBatches:
    """Windows of real text (the standard library's own sources, as the main job uses),
    drawn by a generator seeded per step: step s gives the same global batch in every
    variant, and rank r takes rows [r*micro, (r+1)*micro) of it."""

    def __init__(self, seed: int, world_size: int, micro_batch: int, seq_len: int):
        self.seed = seed
        self.world_size = world_size
        self.micro_batch = micro_batch
        self.seq_len = seq_len
        self.corpus = _stdlib_corpus(CORPUS_BYTES)

    def batch(self, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        rows = self.world_size * self.micro_batch
        starts = torch.randint(0, len(self.corpus) - self.seq_len - 1, (rows,), generator=generator)
        mine = starts[rank * self.micro_batch : (rank + 1) * self.micro_batch]
        windows = torch.stack([self.corpus[s : s + self.seq_len + 1] for s in mine.tolist()]).long()
        return windows[:, :-1], windows[:, 1:]


def _stdlib_corpus(num_bytes: int) -> torch.Tensor:
    chunks, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= num_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:num_bytes]), dtype=torch.uint8)


@dataclass
class StepRecord:
    seconds: list[float] = field(default_factory=list)  # wall clock, timed steps only
    cpu_seconds: list[float] = field(default_factory=list)  # CPU time of all the rank's threads
    minor_faults: list[int] = field(default_factory=list)  # pages first touched (memory handed back and re-taken)
    losses: list[float] = field(default_factory=list)  # every step, warm-up included


def timed_steps(
    train_step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    batches: ByteBatches,
    rank: int,
    warmup: int,
    steps: int,
    *,
    barrier: Callable[[], None] = dist.barrier,
) -> StepRecord:
    """Run warmup + steps training steps; time only the last `steps`.

    A barrier (outside the timed region) starts every step on all ranks together, so a
    step's time on one rank does not include waiting for a peer that is still finishing
    the previous one. The parent takes the slowest rank per step. `barrier`: another
    way to meet, for ranks without a process group.
    """
    record = StepRecord()
    for step in range(warmup + steps):
        inputs, targets = batches.batch(step, rank)
        barrier()
        faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        started, cpu_started = time.perf_counter(), time.process_time()
        loss = train_step(inputs, targets)
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before
        record.losses.append(float(loss))
        if step >= warmup:
            record.seconds.append(elapsed)
            record.cpu_seconds.append(cpu)
            record.minor_faults.append(faults)
    return record


class TorchLoopStep:
    """One training step the plain-torch way (DDP, FSDP2): backward, clip, step, zero;
    remembers the most gradient bytes alive at once, for the model-state column."""

    def __init__(self, forward: Callable[..., torch.Tensor], model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, clip: float):
        self.forward, self.model, self.optimizer, self.clip = forward, model, optimizer, clip
        self.grad_bytes = 0

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = self.forward(inputs, targets)
        loss.backward()
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()
        grads = (p.grad for p in self.model.parameters() if p.grad is not None)
        self.grad_bytes = max(self.grad_bytes, local_bytes(grads))
        self.optimizer.zero_grad()
        return loss.detach()


def engine_step(engine: Any) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """One training step through a DeepSpeed-style engine (shardwise, DeepSpeed)."""

    def train_step(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = engine(inputs, targets)
        engine.backward(loss)
        engine.step()
        return loss.detach()

    return train_step


def rss_bytes() -> int:
    """Resident set size now."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """High-water mark of this process's resident set (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes this rank stores for `tensors` (a DTensor counts its local shard), each once."""
    seen, total = set(), 0
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        key = (local.data_ptr(), local.numel())
        if key not in seen:
            seen.add(key)
            total += local.numel() * local.element_size()
    return total


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Per-element optimizer state (exp_avg, exp_avg_sq); scalar `step` counters excluded."""
    return local_bytes(
        value
        for state in optimizer.state.values()
        for value in state.values()
        if torch.is_tensor(value) and value.dim() > 0
    )


def write_result(rank: int, result: dict[str, Any]) -> None:
    path = Path(os.environ[RESULT_DIR_VARIABLE], f"rank{rank}.json")
    path.write_text(json.dumps(result))


def rank_result(variant: str, record: StepRecord, baseline_rss: int, **measured: Any) -> dict[str, Any]:
    """What a rank reports: its step times, losses, memory high-water marks and extras."""
    return {
        "variant": variant,
        **asdict(record),
        "baseline_rss": baseline_rss,
        "peak_rss": peak_rss_bytes(),
        **measured,
    }
