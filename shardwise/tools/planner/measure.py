"""`shardwise estimate --measure PATH`: the speeds of the machine it runs on, for the time
model (shardwise/formulas/step_time.py).

`ranks` processes (default: one per core, as the training ranks run) join a gloo group
and measure, all at once so that they compete for the machine as training ranks do:

    peak_flops        a square fp32 matmul on one thread (the best the cores do)
    mfu               the forward and backward of a few-layer GPT of the estimated model's
                      width, heads, sequence and micro-batch (model FLOPs, step_time.py)
                      over that peak: small matrices reach less of the peak than large ones
    memory_bandwidth  fused AdamW with the clipping norm over 4M parameters, 32 bytes each
                      (optimizer_update_bytes): the update as the engine runs it
    pcie_bandwidth    a host-to-host copy (offload "to the CPU" on a CPU is a copy)
    nvme_bandwidth    writing and reading back a file in the temporary directory
    intra_node link   α from the all-reduce of 1 KiB, β from 16 MiB (ring: 2(n−1) steps),
                      through the engine's own communicator, so over the transport training
                      uses (shared memory between ranks of one host, else gloo's TCP)

Collectives on gloo run on threads that take the cores compute needs when every core
runs a rank, so nothing hides behind compute there: `overlap` is 0 (1 with spare cores).
The profile also keeps the cores the ranks shared (`host_cores`): with more ranks than
cores, a phase where some ranks idle (a pipeline's warm-up and cool-down) computes faster
than the rates measured with every rank busy (step_time.py).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shardwise.formulas.step_time import Link, Speeds, training_flops_per_token
from shardwise.runtime.distributed.collectives import Communicator
from shardwise.runtime.distributed.mesh import ParallelMesh, ParallelSizes
from shardwise.runtime.distributed.setup import collective_timeout
from shardwise.tools.planner.devices import save_profile

PROBE_PARAMS = 4 * 1024 * 1024
WARMUP_CALLS = 3
SMALL_MESSAGE, LARGE_MESSAGE = 1024, 16 * 1024 * 1024


@dataclass(frozen=True)
class ProbeShape:
    """The model layout the MFU is measured on (GPT 10m's by default)."""

    hidden: int = 384
    heads: int = 6
    seq_len: int = 256
    micro_batch: int = 2
    vocab: int = 256
    layers: int = 2  # a few layers are enough where the model is large; more cost time


def measure(path: str | Path, *, ranks: int | None = None, probe: ProbeShape = ProbeShape()) -> Speeds:
    """Measure this machine with `ranks` processes and write the profile to `path`."""
    ranks = ranks or max(1, min(os.cpu_count() or 1, 8))
    with tempfile.TemporaryDirectory(prefix="shardwise-measure-") as workdir:
        mp.start_processes(_rank_probe, args=(ranks, workdir, probe), nprocs=ranks, start_method="spawn")
        speeds = torch.load(Path(workdir, "speeds.pt"), weights_only=False)
    save_profile(speeds, path)
    return speeds


def _best_seconds(action: Callable[[], object], repeats: int, barrier: bool = True) -> float:
    """The median of `repeats` timings, every rank starting together."""
    times = []
    for _ in range(repeats):
        if barrier:
            dist.barrier()
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def compute_rates(probe: ProbeShape, repeats: int = 7) -> tuple[float, float]:
    """(peak, achieved) FLOP/s of this process on one thread: a 512² matmul, and the forward
    and backward of `probe`'s 2-layer GPT. Inside a process group every rank starts each
    timing together, so they compete for the cores as training ranks do."""
    from shardwise.models import GPT, GPTConfig

    torch.set_num_threads(1)
    barrier = dist.is_initialized()
    size = 512
    a, b = torch.randn(size, size), torch.randn(size, size)
    peak = 2 * size**3 / _best_seconds(lambda: a @ b, 20, barrier)
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=probe.vocab, block_size=probe.seq_len, n_layer=probe.layers, n_head=probe.heads,
                       n_embd=probe.hidden)
    model = GPT(config)
    tokens = torch.randint(0, config.vocab_size, (probe.micro_batch, probe.seq_len + 1))

    def forward_backward() -> None:
        model(tokens[:, :-1], tokens[:, 1:]).backward()

    for _ in range(WARMUP_CALLS):  # the first calls fault pages in and allocate the gradients: several times slower
        forward_backward()
    params = sum(p.numel() for p in model.parameters())
    flops = training_flops_per_token(params, layers=probe.layers, hidden=probe.hidden,
                                     seq_len=probe.seq_len) * probe.micro_batch * probe.seq_len
    achieved = flops / _best_seconds(forward_backward, repeats, barrier)
    return max(peak, achieved), achieved


def _rank_probe(rank: int, world: int, workdir: str, probe: ProbeShape) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=world)
    peak, achieved = compute_rates(probe)

    weights = torch.zeros(PROBE_PARAMS)
    weights.grad = torch.randn(PROBE_PARAMS)
    optimizer = torch.optim.AdamW([weights], lr=1e-4, fused=True)

    def update() -> None:
        torch.nn.utils.clip_grad_norm_([weights], 1.0)
        optimizer.step()

    for _ in range(WARMUP_CALLS):
        update()
    memory = 32 * PROBE_PARAMS / _best_seconds(update, 10)
    source, target = torch.randn(PROBE_PARAMS * 4), torch.empty(PROBE_PARAMS * 4)
    copy = source.numel() * 4 / _best_seconds(lambda: target.copy_(source), 10)
    nvme = _file_bandwidth(Path(workdir, f"nvme{rank}.bin"))

    comm = Communicator(ParallelMesh(ParallelSizes(data_shard=world), rank, torch.device("cpu"),
                                     collective_timeout())["shard"])
    small, large = torch.zeros(SMALL_MESSAGE // 4), torch.zeros(LARGE_MESSAGE // 4)
    comm.all_reduce(small, "link probe").wait()  # a shared-memory segment is agreed at the first call
    small_s = min(_best_seconds(lambda: comm.all_reduce(small, "link probe").wait(), 10)
                  for _ in range(5))  # α: the least delay
    large_s = _best_seconds(lambda: comm.all_reduce(large, "link probe").wait(), 5)
    steps = 2 * (world - 1)
    latency = small_s / steps if world > 1 else 0.0
    sent = 2 * LARGE_MESSAGE * (world - 1) / world
    bandwidth = sent / max(large_s - steps * latency, 1e-9) if world > 1 else 1e12

    gathered = [torch.zeros(7, dtype=torch.float64) for _ in range(world)]
    mine = torch.tensor([peak, achieved / peak, memory, copy, nvme, latency, bandwidth], dtype=torch.float64)
    dist.all_gather(gathered, mine)
    if rank == 0:  # the slowest rank sets the pace of a synchronous step
        worst = torch.stack(gathered)
        lowest = worst.min(dim=0).values.tolist()
        cores = os.cpu_count() or 1
        link = Link(latency_s=float(worst[:, 5].max()), bandwidth=lowest[6])
        speeds = Speeds(f"this machine ({cores} cores, {world} ranks)", lowest[0], min(1.0, lowest[1]), lowest[2],
                        link, link, host_bandwidth=lowest[2], pcie_bandwidth=lowest[3], nvme_bandwidth=lowest[4],
                        overlap=0.0 if world >= cores else 1.0,
                        host_cores=cores,
                        source=f"shardwise estimate --measure (MFU on {probe.layers} GPT layers, h={probe.hidden}, "
                               f"s={probe.seq_len}, b={probe.micro_batch})")
        torch.save(speeds, Path(workdir, "speeds.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _file_bandwidth(path: Path, megabytes: int = 64) -> float:
    """Bytes per second writing `megabytes` of random bytes to a file (synced) and reading
    them back."""
    payload = os.urandom(1 << 20) * megabytes
    started = time.perf_counter()
    with open(path, "wb") as handle:
        handle.write(payload)
        handle.flush()
        os.fsync(handle.fileno())
    with open(path, "rb") as handle:
        handle.read()
    elapsed = time.perf_counter() - started
    path.unlink()
    return 2 * len(payload) / elapsed
