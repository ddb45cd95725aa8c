"""`deepspeed.comm`'s other collectives and DeepSpeed's communication logger
(api/comms_logging.py): results equal torch's, the logger counts what it profiles by
message size, and its bandwidths are DeepSpeed 0.19.8's arithmetic."""

import pytest
import torch
from torch import nn

import shardwise.frontends.deepspeed.api as deepspeed
from shardwise.frontends.deepspeed.api import comms_logging
from shardwise.tools.testing import run_distributed


def collectives_and_log(rank: int, world_size: int) -> dict:
    dist = deepspeed.comm
    dist.reset_log()
    dist.configure(enabled=True, prof_all=True)
    try:
        a, b = torch.full((4,), float(rank + 1)), torch.full((2, 3), float(10 * rank))
        dist.all_reduce_coalesced([a, b])
        gathered = [torch.zeros(2), torch.zeros(4)]
        dist.all_gather_coalesced(gathered, [torch.full((1,), float(rank)), torch.full((2,), float(rank + 5))])
        total = torch.ones(4)
        dist.all_reduce(total)
        dist.all_reduce(torch.ones(8), log_name="renamed all_reduce")
        ops = dist.get_logged_comm_ops()
        result = dist.log_summary(return_dict=True)
        counted = dist.get_comm_operation_count()
        dist.reset_log()
        dist.configure(prof_all=False, prof_ops=["broadcast"])
        dist.all_reduce(torch.ones(2))  # not listed: not timed
        dist.all_reduce(torch.ones(3), prof=True)  # asked for
        dist.broadcast(torch.ones(5), src=0)
        listed = sorted(dist.get_logged_comm_ops())
    finally:
        dist.configure(enabled=False, prof_all=True, prof_ops=[])
        dist.reset_log()
    return {"coalesced": (a.tolist(), b.flatten().tolist()), "gathered": [t.tolist() for t in gathered],
            "total": total.tolist(), "ops": ops, "counted": counted, "after_reset": dist.has_comm_data(),
            "summary": {op: {size: row["count"] for size, row in sizes.items()}
                        for op, sizes in result["summary"].items()},
            "metadata": (result["metadata"]["world_size"], result["metadata"]["rank"]), "listed": listed,
            "ranks": dist.get_all_ranks_from_group(), "capabilities": (dist.has_all_gather_into_tensor(),
                                                                        dist.has_reduce_scatter_tensor()),
            "launcher": (dist.get_world_rank_from_launcher(), dist.get_world_size_from_launcher())}


def test_coalesced_collectives_equal_torchs_and_the_logger_counts_what_it_profiles():
    for rank, result in enumerate(run_distributed(collectives_and_log, 2)):
        assert result["coalesced"] == ([3.0] * 4, [10.0] * 6)
        assert result["gathered"] == [[0.0, 1.0], [5.0, 5.0, 6.0, 6.0]]
        assert result["total"] == [2.0] * 4
        assert result["ops"] == ["all_reduce_coalesced", "all_gather_coalesced", "all_reduce", "renamed all_reduce"]
        # message sizes as DeepSpeed counts them: every tensor of a list; all_gather_coalesced's
        # arguments are none of the names it looks for, so 0 bytes
        assert result["summary"] == {"all_reduce_coalesced": {40: 1}, "all_gather_coalesced": {0: 1},
                                     "all_reduce": {16: 1}, "renamed all_reduce": {32: 1}}
        assert result["counted"] == 4 and result["after_reset"] is False
        assert result["metadata"] == (2, rank)
        assert result["listed"] == ["all_reduce", "broadcast"]  # the asked-for all_reduce and the listed broadcast
        assert result["ranks"] == [0, 1] and result["capabilities"] == (True, True)
        assert result["launcher"] == (rank, 2)


@pytest.mark.parametrize(("op", "expected"), [
    ("all_reduce", (16.0, 8.0)),  # 2 · size / t, and size / t · 2(n − 1) / n
    ("all_gather_into_tensor", (16.0, 8.0)),  # n · size / t, and that · (n − 1) / n
    ("all_to_all_single", (8.0, 4.0)),  # size / t, and that · (n − 1) / n
    ("broadcast", (8.0, 8.0)),  # size / t both
])
def test_bandwidths_are_deepspeeds_arithmetic(op, expected):
    """1 MB in 1 ms on 2 ranks, in Gbps (DeepSpeed's `calc_bw_log`: bytes · 8 / 1e6 per ms)."""
    assert comms_logging.bandwidths(op, 10**6, 1.0, 2) == pytest.approx(expected)


def logger_from_the_config(rank: int, world_size: int) -> list[str]:
    model = nn.Linear(2, 2)
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "comms_logger": {"enabled": True, "prof_all": False, "prof_ops": ["all_reduce"]}}
    engine, *_ = deepspeed.initialize(model=model, config=config)
    try:
        deepspeed.comm.all_reduce(torch.ones(2))
        deepspeed.comm.broadcast(torch.ones(2), src=0)
        return deepspeed.comm.get_logged_comm_ops()
    finally:
        deepspeed.comm.configure(enabled=False, prof_all=True, prof_ops=[])
        deepspeed.comm.reset_log()
        engine.destroy()


def test_the_configs_comms_logger_block_switches_the_logger_on():
    assert run_distributed(logger_from_the_config, 1) == [["all_reduce"]]
