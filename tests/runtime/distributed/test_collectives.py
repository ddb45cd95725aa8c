"""A communicator per group: rank and size from its group, broadcasts by group rank (a
group without global rank 0 works), bytes counted per (group, operation), and errors that
name the group (issue: engine architecture, deliverable 2)."""

import time

import pytest
import torch
import torch.distributed as dist

from shardwise.runtime.distributed.collectives import Communicator
from shardwise.runtime.distributed.mesh import GroupHandle
from shardwise.tools.testing import run_distributed
from tests.runtime.distributed.workers import exercise_groups, stall_in_subgroup


def test_broadcast_all_to_all_and_accounting_per_group():
    results = run_distributed(exercise_groups, 4)
    # replicate groups are [0, 2] and [1, 3]: their member 1 is global rank 2 or 3
    assert [r["broadcast"] for r in results] == [2.0, 3.0, 2.0, 3.0]
    assert [r["group_rank"] for r in results] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    # shard groups [0, 1] and [2, 3]: chunk j of rank i goes to rank j
    assert results[0]["all_to_all"] == [0.0, 1.0, 10.0, 11.0]
    assert results[1]["all_to_all"] == [2.0, 3.0, 12.0, 13.0]
    assert results[3]["all_to_all"] == [22.0, 23.0, 32.0, 33.0]
    for result in results:
        # all-to-all of 16 bytes over 2 ranks sends 8; all-reduce of 32 bytes over 2 sends 2 * 16
        assert result["volume"]["shard"] == {"all_to_all": 8}
        assert result["volume"]["replicate"] == {"broadcast": 2, "all_reduce": 32}


def test_a_stalled_collective_names_its_group():
    started = time.monotonic()
    message = run_distributed(stall_in_subgroup, 4, timeout=60, env={"SHARDWISE_COLLECTIVE_TIMEOUT": "2"})[1]
    assert message.startswith("rank 1: all_reduce of a payload in the replicate group (ranks [1, 3]) failed after")
    assert time.monotonic() - started < 30


class NcclStandIn:
    """A stand-in for an NCCL group (this machine has no GPU): `dist.get_backend` reports
    `backend` for it, and `dist.all_reduce` records what reached it instead of sending."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, backend: str):
        self.group = object()
        self.issued: list[torch.Tensor] = []
        monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
        monkeypatch.setattr(dist, "all_reduce", lambda tensor, **kwargs: self.issued.append(tensor))

    def communicator(self) -> Communicator:
        return Communicator(GroupHandle("shard", (0, 1), 0, self.group, None))


def test_an_nccl_group_refuses_host_tensors_naming_the_operation(monkeypatch):
    comm = NcclStandIn(monkeypatch, "nccl").communicator()
    host = torch.ones(4)
    calls = {
        "all_reduce": lambda: comm.all_reduce(host, "gradients of unit 3"),
        "reduce_scatter": lambda: comm.reduce_scatter(host[:2], host, "gradients of unit 3"),
        "all_gather": lambda: comm.all_gather(host, host[:2], "gradients of unit 3"),
        "all_to_all": lambda: comm.all_to_all(torch.empty(4), host, "gradients of unit 3"),
        "broadcast": lambda: comm.broadcast(host, 0, "gradients of unit 3"),
    }
    refusal = r"the group is NCCL's, which moves CUDA tensors only, but this one is on cpu"
    for op, call in calls.items():
        with pytest.raises(ValueError, match=rf"rank 0: {op} of gradients of unit 3 in the shard group \(ranks 0-1\): "
                                             + refusal):
            call()
    with pytest.raises(ValueError, match="all_gather of pieces"):
        comm.all_gather_pieces([torch.empty(2), torch.empty(2)], host[:2], "pieces")
    assert not comm.stats.volume  # refused before anything was counted or issued


def test_a_gloo_group_takes_host_tensors(monkeypatch):
    stand_in = NcclStandIn(monkeypatch, "gloo")
    comm = stand_in.communicator()
    host = torch.ones(4)
    comm.all_reduce(host, "ones").wait()
    assert stand_in.issued == [host]
