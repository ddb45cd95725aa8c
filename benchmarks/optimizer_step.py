"""Optimizer step time per million parameters and state memory, every optimizer on the
same shard, in one run (issue 14, C16-C18).

    .venv/bin/python benchmarks/optimizer_step.py [--model-size 10m] [--threads 1] [--repeats 7] [--only A,B]

The shard is the main job's GPT's fp32 parameters (whole, as at ZeRO stage 0 or one
rank's view of them), with fixed random gradients. Each optimizer takes warm-up steps
(its state exists, 1-bit ones are past their freeze, compiled ones compiled), then the
median of `--repeats` timed steps is reported per million parameters, beside torch's
AdamW (foreach and fused kernels) on the same tensors, with the bytes of optimizer state
per parameter and the wall time of the three warm-up steps (for "(compiled)" rows, mostly
torch.compile's: long with Inductor's cache cold, seconds with it warm). "vs fused AdamW"
divides each row's time by that of a fused AdamW over its own copy of the shard, timed for
as many steps right before the row's (its median in brackets), so each ratio compares
steps taken moments apart.

Step times are the process's CPU time, not the wall clock: on a shared machine a
wall-clock step also counts the time other processes held the core (at load 10 on two
cores, several times the step itself), the CPU time does not (memory-bandwidth contention
still shows in it).

Rows marked "(torch ops)" are the same optimizers with their native kernels off
(`SHARDWISE_NATIVE_OPTIM=0`, optim/native.py): their multi-tensor torch path, the
"before" of issue 27. "Adafactor (ZeRO order)" is Adafactor with its whole parameters
declared as ZeRO's pieces over a group of one: the order it steps in under ZeRO (each
pass over every parameter, a sum between passes), where without ZeRO it runs each
parameter's passes back to back, in cache. "bitsandbytes Adam8bit" is bitsandbytes' own (its CPU code), where
it is installed. "limit" is the least time the step could take on this core: the bytes
the optimizer's algorithm must move per parameter (its arrays read and written once per
pass it needs, `MIN_BYTES`) at the memory bandwidth of a large copy measured in the same
run; Muon and the 1-bit optimizers have no such row (Newton-Schulz is compute-bound,
benchmarks/muon_newton_schulz.py; the exchange is not a stream over the arrays).

The 1-bit optimizers run as one rank of two: a loopback group stands in for the peer
(what this rank sends comes back as the peer's), so the time is the compression,
packing, decompression and update arithmetic without the network; their "(warm-up)" rows
are the same optimizers before `freeze_step` (Adam / LAMB on a reduced gradient, no
exchange), so the difference is what the compression costs. 0/1 Adam's rows are its three
kinds of step after the set-up (formulas/communication.py `zero_one_adam_step_kinds`):
the gradient through the exchange, a synchronisation of the accumulated update, and a
local step (no exchange). `--only ZeroOneAdam,OneBitAdam` runs those rows alone.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from typing import Callable

import torch

from shardwise.models import GPT, GPTConfig


class _Loopback:
    """A two-rank group whose other rank sends exactly what this one does."""

    size = 2

    class _Done:
        work = None

        def wait(self) -> None:
            return None

    def all_to_all(self, output: torch.Tensor, tensor: torch.Tensor, what: str) -> "_Loopback._Done":
        output.copy_(tensor)
        return self._Done()

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor, what: str) -> "_Loopback._Done":
        full.view(self.size, -1).copy_(shard.view(1, -1).expand(self.size, -1))
        return self._Done()


# Bytes per parameter each optimizer's algorithm must move at the least (fp32 weights,
# gradients and states; each array read, or written, once per pass over it).
MIN_BYTES = {
    "torch AdamW": 28,  # read w, g, m, v; write w, m, v
    "Lamb": 40,  # pass 1 reads w, g, m, v, writes m, v; the norms; pass 2 reads w, m, v, writes w
    "Lars": 28,  # norms read w, g; then read w, g, buffer, write w, buffer
    "Lion": 20,  # read w, g, m; write w, m
    "torch Adagrad": 20,  # read w, g, sum; write w, sum
    "Adam8bit": 16 + 16 / 256,  # read w, g, 2 codes; write w, 2 codes; 2 scales per block of 256
    "bitsandbytes Adam8bit": 16 + 16 / 256,
    "Adafactor": 20,  # g for the row and column statistics; g for RMS(U); g, w read and w written
    "torch Adafactor": 20,
}
NATIVE_OFF = {"SHARDWISE_NATIVE_OPTIM": "0"}


@contextlib.contextmanager
def environment(variables: dict[str, str]):
    saved = {key: os.environ.get(key) for key in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key)
            else:
                os.environ[key] = value


def copy_bandwidth(numel: int = 1 << 26, repeats: int = 5) -> float:
    """Bytes per CPU second of a large fp32 copy: 12 bytes per element, as the core moves
    them (the source read, the target's lines read before they are written, and
    written). An optimizer's in-place updates read the lines they write anyway, so
    MIN_BYTES counts each array once per pass read and once written."""
    source, target = torch.ones(numel), torch.empty(numel)
    target.copy_(source)
    times = []
    for _ in range(repeats):
        started = time.process_time()
        target.copy_(source)
        times.append(time.process_time() - started)
    return 12 * numel / statistics.median(times)


def bitsandbytes_adam8bit() -> Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer] | None:
    try:
        import bitsandbytes
    except ImportError:
        return None
    return lambda p: bitsandbytes.optim.Adam8bit(p, lr=1e-3)


def optimizers(lr: float) -> dict[str, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]]:
    from shardwise.runtime.optim import Adafactor, Adam8bit, Lamb, Lars, Lion, Muon, OneBitAdam, OneBitLamb, ZeroOneAdam
    from shardwise.runtime.optim.sharded import ParameterShard, ShardAwareOptimizer

    def onebit(cls: type, freeze_step: int = 1) -> Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]:
        def build(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
            optimizer = cls(params, lr=lr, freeze_step=freeze_step)
            optimizer.attach_gradient_exchange(_Loopback(), lambda on: None)
            return optimizer
        return build

    def zero_one(**schedule: int) -> Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]:
        def build(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
            optimizer = ZeroOneAdam(params, lr=lr, **schedule)
            optimizer.attach_gradient_exchange(_Loopback(), lambda on: None)
            return optimizer
        return build

    def zero_order(optimizer: ShardAwareOptimizer) -> ShardAwareOptimizer:
        """The whole parameters declared as ZeRO's pieces, summed over a group of one: the
        step's order under ZeRO (each pass over every parameter, a sum between passes)."""
        params = [param for group in optimizer.param_groups for param in group["params"]]
        optimizer.attach_shards({param: ParameterShard(f"p{index}", tuple(param.shape), 0, param.numel(), index)
                                 for index, param in enumerate(params)}, len(params), lambda tensor: tensor)
        return optimizer

    rows = {
        "torch AdamW (foreach)": lambda p: torch.optim.AdamW(p, lr=lr, foreach=True),
        "torch AdamW (fused)": lambda p: torch.optim.AdamW(p, lr=lr, fused=True),
        "Lamb": lambda p: Lamb(p, lr=lr),
        "Lamb (torch ops)": lambda p: Lamb(p, lr=lr),
        "Lamb (torch ops, compiled)": lambda p: Lamb(p, lr=lr, compile=True),
        "Lars": lambda p: Lars(p, lr=lr, momentum=0.9),
        "Lars (torch ops)": lambda p: Lars(p, lr=lr, momentum=0.9),
        "Lars (torch ops, compiled)": lambda p: Lars(p, lr=lr, momentum=0.9, compile=True),
        "Lion": lambda p: Lion(p, lr=lr, weight_decay=0.01),
        "torch Adagrad": lambda p: torch.optim.Adagrad(p, lr=lr),
        "Adafactor": lambda p: Adafactor(p, lr=lr),
        "Adafactor (ZeRO order)": lambda p: zero_order(Adafactor(p, lr=lr)),
        "Adafactor (torch ops)": lambda p: Adafactor(p, lr=lr),
        "torch Adafactor": lambda p: torch.optim.Adafactor(p, lr=lr),
        "Adam8bit": lambda p: Adam8bit(p, lr=lr),
        "Adam8bit (torch ops)": lambda p: Adam8bit(p, lr=lr),
        "Muon": lambda p: Muon(p, lr=lr),
        "Muon (fp32 Newton-Schulz)": lambda p: Muon(p, lr=lr, ns_dtype="float32"),
        "OneBitAdam (warm-up)": onebit(OneBitAdam, freeze_step=10**6),
        "OneBitAdam": onebit(OneBitAdam),
        "OneBitAdam (torch ops)": onebit(OneBitAdam),
        "OneBitLamb (warm-up)": onebit(OneBitLamb, freeze_step=10**6),
        "OneBitLamb": onebit(OneBitLamb),
        "OneBitLamb (torch ops)": onebit(OneBitLamb),
        # (the timed steps 4-10 by the schedule; the median is the row's kind)
        "ZeroOneAdam (1-bit gradient)": zero_one(var_freeze_step=10**6, var_update_scaler=1),  # 5 of 7
        "ZeroOneAdam (synchronisation)": zero_one(var_freeze_step=1),  # all 7
        "ZeroOneAdam (local)": zero_one(var_freeze_step=1, local_step_scaler=1, local_step_clipper=1024),  # 6 of 7
    }
    theirs = bitsandbytes_adam8bit()
    if theirs is not None:
        rows["bitsandbytes Adam8bit"] = theirs
    return rows


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    total = sum(value.numel() * value.element_size() for state in optimizer.state.values()
                for value in state.values() if torch.is_tensor(value) and value.dim() > 0)
    exchange = getattr(optimizer, "exchange_state_bytes", None)
    return total + (exchange() if exchange else 0)


def stepping(build: Callable, shapes: list[torch.Size], grads: list[torch.Tensor]) -> torch.optim.Optimizer:
    """`build`'s optimizer over fresh parameters of `shapes` with the gradients `grads`."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape) * 0.02) for shape in shapes]
    for param, grad in zip(params, grads):
        param.grad = grad.clone()
    return build(params)


def timed_step(optimizer: torch.optim.Optimizer) -> float:
    started = time.process_time()
    optimizer.step()
    return time.process_time() - started


def measure(build: Callable, shapes: list[torch.Size], grads: list[torch.Tensor], repeats: int,
            beside: torch.optim.Optimizer) -> tuple[float, int, float, float]:
    """(median CPU seconds per step, state bytes, wall seconds of the three warm-up steps:
    state created and, for compiled optimizers, their kernels compiled, median CPU seconds
    of `beside`'s steps). `beside` (torch's fused AdamW over parameters of its own) takes
    as many timed steps right before the row's, so the row's ratio to it compares steps
    taken seconds apart: on a shared host the bandwidth a core gets drifts over a
    run by more than the differences measured. (Steps taken in turn instead would evict
    each other's arrays from the cache, which steps taken back to back partly keep.)"""
    beside.step()  # its arrays back where its own steps leave them
    beside_times = [timed_step(beside) for _ in range(repeats)]
    optimizer = stepping(build, shapes, grads)
    started = time.perf_counter()
    for _ in range(3):  # state created; 1-bit optimizers past freeze_step; compiled ones compiled
        optimizer.step()
    warm_up = time.perf_counter() - started
    times = [timed_step(optimizer) for _ in range(repeats)]
    return statistics.median(times), state_bytes(optimizer), warm_up, statistics.median(beside_times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-size", default="10m")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--only", default="", help="comma-separated row-name prefixes to run (torch's fused "
                        "AdamW always runs, for the ratio); default: every row")
    args = parser.parse_args()
    prefixes = [prefix for prefix in args.only.split(",") if prefix]
    torch.set_num_threads(args.threads)
    model = GPT(GPTConfig.preset(args.model_size))
    shapes = [param.shape for param in model.parameters()]
    numel = sum(param.numel() for param in model.parameters())
    generator = torch.Generator().manual_seed(1)
    grads = [torch.randn(shape, generator=generator) * 1e-3 for shape in shapes]
    del model
    bandwidth = copy_bandwidth()
    rows = optimizers(1e-3)
    beside = stepping(rows["torch AdamW (fused)"], shapes, grads)
    for _ in range(3):
        beside.step()
    results = {}
    for name, build in rows.items():
        if prefixes and name != "torch AdamW (fused)" and not any(name.startswith(p) for p in prefixes):
            continue
        with environment(NATIVE_OFF if "torch ops" in name else {}):
            results[name] = measure(build, shapes, grads, args.repeats, beside)
    print(f"{numel / 1e6:.2f}M parameters in {len(shapes)} tensors, fp32, {args.threads} thread(s), "
          f"median of {args.repeats} steps; copy bandwidth {bandwidth / 1e9:.1f} GB/s; "
          f"load average {' '.join(f'{load:.1f}' for load in os.getloadavg())}")
    print("| optimizer | ms per step | ms per M params | vs fused AdamW (its ms, beside) | limit, ms (bytes / param) "
          "| vs limit | state bytes / param | warm-up, s |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (seconds, nbytes, warm_up, fused) in results.items():
        moved = MIN_BYTES.get(name.split(" (")[0])
        limit = moved * numel / bandwidth if moved else None
        limits = f"{limit * 1e3:.1f} ({moved:.0f}) | {seconds / limit:.2f}x" if limit else "- | -"
        print(f"| {name} | {seconds * 1e3:.1f} | {seconds * 1e3 / (numel / 1e6):.2f} | {seconds / fused:.2f}x "
              f"({fused * 1e3:.1f}) | {limits} | {nbytes / numel:.3f} | {warm_up:.1f} |")


if __name__ == "__main__":
    main()
