"""Rank functions for the communicator tests: a 2 x 2 mesh (replicate x shard) on 4 ranks,
and groups of one that issue their collectives (the test-only switch)."""

from __future__ import annotations

import datetime
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from shardwise.runtime.distributed.collectives import CollectiveError, CommStats, Communicator
from shardwise.runtime.distributed.mesh import ParallelMesh, ParallelSizes
from shardwise.runtime.distributed.setup import collective_timeout

SIZES = ParallelSizes(data_replicate=2, data_shard=2)


def communicators(rank: int) -> dict[str, Communicator]:
    mesh = ParallelMesh(SIZES, rank, torch.device("cpu"), collective_timeout())
    stats = CommStats()
    return {purpose: Communicator(mesh[purpose], stats) for purpose in ("shard", "replicate", "replicas")}


def exercise_groups(rank: int, world_size: int) -> dict:
    comms = communicators(rank)
    replicate = comms["replicate"]  # [0, 2] and [1, 3]
    value = torch.tensor([float(rank)])
    replicate.broadcast(value, 1, "a value from the second member")  # global rank 2 or 3
    shard = comms["shard"]  # [0, 1] and [2, 3]
    sent = torch.arange(4, dtype=torch.float32) + 10 * rank
    received = torch.empty(4)
    shard.all_to_all(received, sent, "a test exchange").wait()
    total = torch.ones(8)
    replicate.all_reduce(total, "ones").wait()
    return {
        "broadcast": value.item(),
        "all_to_all": received.tolist(),
        "group_rank": (shard.rank, replicate.rank),
        "volume": shard.stats.by_group(),
    }


def stall_in_subgroup(rank: int, world_size: int) -> str:
    comms = communicators(rank)
    if rank == 3:
        time.sleep(5)
        return "stalled"
    if rank == 1:
        try:
            comms["replicate"].all_reduce(torch.ones(4), "a payload").wait()
        except CollectiveError as error:
            return str(error)
    return "not involved"


# torch.distributed's Python entry points, by the collective they issue. The older and
# newer names of one operation both count (one wraps the other: only the outer call counts).
ENTRY_POINTS = {
    "all_reduce": "all_reduce",
    "reduce_scatter_single": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter",
    "all_gather_single": "all_gather", "all_gather_into_tensor": "all_gather", "_all_gather_base": "all_gather",
    "all_gather": "all_gather",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
}


@contextmanager
def counted_collectives() -> Iterator[Counter]:
    """Count, per operation, the calls this process makes to torch.distributed's collective
    functions (they still run). It sees calls made through `torch.distributed.<name>` or
    `torch.distributed.distributed_c10d.<name>` looked up at call time, and through the
    names shardwise's torch compatibility module binds (as the communicators import them);
    a call made through another name bound before entering is not seen."""
    from shardwise.runtime.base import torch_compat
    from shardwise.runtime.distributed import collectives

    counts: Counter = Counter()
    inside = [False]
    originals = [(module, name, getattr(module, name)) for module in (dist, c10d, torch_compat, collectives)
                 for name in ENTRY_POINTS if hasattr(module, name)]

    def counting(name: str, original):
        def call(*args, **kwargs):
            if inside[0]:
                return original(*args, **kwargs)
            inside[0] = True
            try:
                counts[ENTRY_POINTS[name]] += 1
                return original(*args, **kwargs)
            finally:
                inside[0] = False
        return call

    for module, name, original in originals:
        setattr(module, name, counting(name, original))
    try:
        yield counts
    finally:
        for module, name, original in originals:
            setattr(module, name, original)


def exercise_group_of_one(rank: int, world_size: int, device: str = "cpu") -> dict:
    """Every data collective of a communicator over a group of one, on `device`: the
    results, the collectives torch.distributed was asked for, and the bytes counted."""
    from shardwise.runtime.distributed.mesh import GroupHandle

    stats = CommStats()
    comm = Communicator(GroupHandle("shard", (rank,), 0, None, None), stats)
    values = torch.arange(8, dtype=torch.float32, device=device)
    with counted_collectives() as counts:
        summed = values.clone()
        pending = comm.all_reduce(summed, "an all-reduce")
        asynchronous = pending.work is not None  # a handle to wait on, not a finished no-op
        pending.wait()
        in_place = values.clone()
        comm.reduce_scatter(in_place, in_place, "an in-place reduce-scatter").wait()  # output aliases input
        scattered = torch.empty_like(values)
        comm.reduce_scatter(scattered, values, "a reduce-scatter").wait()
        gathered_in_place = values.clone()
        comm.all_gather(gathered_in_place, gathered_in_place, "an in-place all-gather").wait()
        gathered = torch.empty_like(values)
        comm.all_gather(gathered, values, "an all-gather").wait()
        pieces = torch.empty_like(values)
        comm.all_gather_pieces([pieces], values, "an all-gather into pieces").wait()
        exchanged = torch.empty_like(values)
        comm.all_to_all(exchanged, values, "an all-to-all").wait()
        broadcast = values.clone()
        comm.broadcast(broadcast, 0, "a broadcast")
    results = {name: tensor.cpu() for name, tensor in (
        ("all_reduce", summed), ("reduce_scatter_in_place", in_place), ("reduce_scatter", scattered),
        ("all_gather_in_place", gathered_in_place), ("all_gather", gathered), ("all_gather_pieces", pieces),
        ("all_to_all", exchanged), ("broadcast", broadcast))}
    return {"issues": not comm.skips_collectives, "results": results, "counts": dict(counts),
            "volume": stats.by_group(), "asynchronous": asynchronous}


def train_counting_collectives(rank: int, world_size: int, cases: list) -> list[dict]:
    """tests/zero's `train_parallel` for each case in turn, with the collectives each issued."""
    from tests.runtime.zero.workers import train_parallel

    results = []
    for case in cases:
        with counted_collectives() as counts:
            result = train_parallel(rank, world_size, case)
        results.append({**result, "collectives": dict(counts)})
    return results


def record_a_stall(rank: int, world_size: int) -> dict:
    """Two all-reduces over the shard group ([0, 1] and [2, 3]) and a control barrier;
    then rank 3 stays away from a third, which rank 2 gives up on: every rank's snapshot
    of the flight recorder, and rank 2's record of the failed one."""
    from shardwise.runtime.distributed.flight_recorder import RECORDER

    shard = communicators(rank)["shard"]
    for _ in range(2):
        shard.all_reduce(torch.ones(16), "ones").wait()
    shard.barrier("a test barrier")
    if rank == 2:
        try:
            shard.all_reduce(torch.ones(16), "the third").wait(datetime.timedelta(seconds=1))
        except CollectiveError:
            pass
    return RECORDER.snapshot()


def shared_and_gloo_collectives(rank: int, world_size: int, dtype: str, sizes: list[int]) -> dict:
    """The same all-gathers, reduce-scatters and all-reduces through the shared segment and through gloo
    (one communicator each over the same group), per chunk size in `sizes`."""
    import os

    mesh = ParallelMesh(ParallelSizes(data_shard=world_size), rank, torch.device("cpu"), collective_timeout())
    shared = Communicator(mesh["shard"], CommStats())
    os.environ["SHARDWISE_SHARED_MEMORY"] = "0"
    gloo = Communicator(mesh["shard"], CommStats())
    kind = getattr(torch, dtype)
    results = []
    for size in sizes:
        generator = torch.Generator().manual_seed(1000 * size + rank)
        shard = torch.randn(size, generator=generator).to(kind)
        full = torch.randn(size * world_size, generator=generator).to(kind)
        outcome = {}
        for name, comm in (("shared", shared), ("gloo", gloo)):
            gathered = torch.empty(size * world_size, dtype=kind)
            pieces = [torch.empty(size, dtype=kind) for _ in range(world_size)]  # apart from each other
            reduced = torch.empty(size, dtype=kind)
            in_place = full.clone()
            summed = torch.cat([full, shard[:1]])  # a length the members do not divide
            divided = full.clone()  # averaged as gradients are: each member's values divided, then summed
            works = [comm.all_gather(gathered, shard, "a shard"), comm.all_gather_pieces(pieces, shard, "pieces"),
                     comm.reduce_scatter(reduced, full, "a full tensor"),
                     comm.reduce_scatter(in_place.chunk(world_size)[rank], in_place, "in place"),
                     comm.all_reduce(summed, "a sum"),
                     comm.reduce_scatter(divided.chunk(world_size)[rank], divided, "divided", divide_by=3.0)]
            for work in works:
                work.wait()
            outcome[name] = {"gathered": gathered, "pieces": torch.cat(pieces), "reduced": reduced,
                             "in_place": in_place.chunk(world_size)[rank].clone(), "summed": summed,
                             "divided": divided.chunk(world_size)[rank].clone()}
        outcome["divided_expected"] = _divided_sum(world_size, rank, size, kind)
        results.append(outcome)
    return {"results": results, "shared_used": shared._shared_memory is not None,
            "gloo_used_shared": gloo._shared_memory is not None,
            "volume": (shared.stats.by_group(), gloo.stats.by_group())}


def _divided_sum(world_size: int, rank: int, size: int, kind: torch.dtype) -> torch.Tensor:
    """Chunk `rank` of the members' `full` tensors (as shared_and_gloo_collectives draws
    them), each divided by 3 in its dtype and summed in member order in float32 (the
    transport's order), rounded once to the dtype."""
    total = None
    for member in range(world_size):
        generator = torch.Generator().manual_seed(1000 * size + member)
        torch.randn(size, generator=generator)  # the member's shard
        full = torch.randn(size * world_size, generator=generator).to(kind)
        term = (full.chunk(world_size)[rank] / 3.0).float()
        total = term if total is None else total + term
    return total.to(kind)


def stall_in_shared_memory(rank: int, world_size: int) -> str:
    """Rank 1 joins one all-gather, then never issues the second."""
    mesh = ParallelMesh(ParallelSizes(data_shard=world_size), rank, torch.device("cpu"), collective_timeout())
    comm = Communicator(mesh["shard"], CommStats())
    full = torch.empty(4 * world_size)
    comm.all_gather(full, torch.ones(4), "a first shard").wait()
    if rank == 1:
        time.sleep(3)
        return "stalled"
    try:
        comm.all_gather(full, torch.ones(4), "parameters of unit 2").wait()
    except CollectiveError as error:
        return str(error)
    return "finished"


def join_shared_segment_and_exit(path: str, nbytes: int, slot: int) -> None:
    """A process that maps the segment as member 1 of 2, joins one all-gather, and exits."""
    from shardwise.runtime.distributed import shared_memory

    kernels = shared_memory.library()
    base, _ = shared_memory.map_segment(kernels, path, nbytes, create=False)
    channel = shared_memory.SharedMemoryChannel(kernels, base, rank=1, global_ranks=(0, 1), slot=slot,
                                                timeout=datetime.timedelta(seconds=30))
    channel.all_gather([torch.empty(4), torch.empty(4)], torch.ones(4)).wait()


def train_through_shared_memory(rank: int, world_size: int, case) -> dict:
    """tests/runtime/zero/workers.py's `train_parallel`, noting how many of the engine's
    groups mapped a shared segment."""
    from shardwise.runtime.distributed import shared_memory
    from tests.runtime.zero.workers import train_parallel

    connect, channels = shared_memory.connect, []

    def noting(**options):
        channel = connect(**options)
        channels.append(channel is not None)
        return channel

    shared_memory.connect = noting
    try:
        result = train_parallel(rank, world_size, case)
    finally:
        shared_memory.connect = connect
    return {**result, "shared_segments": sum(channels)}
