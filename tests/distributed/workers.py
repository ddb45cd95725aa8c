"""Rank functions for the communicator tests: a 2 x 2 mesh (replicate x shard) on 4 ranks."""

from __future__ import annotations

import time

import torch

from shardwise.distributed.collectives import CollectiveError, CommStats, Communicator
from shardwise.distributed.mesh import ParallelMesh, ParallelSizes
from shardwise.distributed.setup import collective_timeout

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
