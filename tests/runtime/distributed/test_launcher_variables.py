"""Ranks from the launchers clusters use instead of torchrun: each launcher's variables
are set for 2 real processes (gloo), which must join one group through `init_distributed`
(what `shardwise.initialize` calls) or DeepSpeed's `init_distributed(auto_mpi_discovery=True)`,
and sum their ranks. The translation itself is checked variable by variable below."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from shardwise.runtime.distributed.launcher_variables import first_host, torchrun_variables

WORKER = """
import json, os, sys
import torch, torch.distributed as dist
entry, port = sys.argv[1], int(sys.argv[2])
if entry == "initialize":
    from shardwise.runtime.distributed.setup import init_distributed
    init_distributed()
else:
    from shardwise.frontends.deepspeed.api.comm import init_distributed
    init_distributed(distributed_port=port)
total = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(total)
print(json.dumps({"rank": dist.get_rank(), "world_size": dist.get_world_size(), "sum": total.item(),
                  "local_rank": os.environ["LOCAL_RANK"], "master": os.environ["MASTER_ADDR"] + ":" +
                  os.environ["MASTER_PORT"]}))
"""

TORCHRUN_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                  "GROUP_RANK", "TORCHELASTIC_RUN_ID")


def _launcher_environment(launcher: str, rank: int) -> dict[str, str]:
    if launcher == "openmpi":
        return {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": "2",
                "OMPI_COMM_WORLD_LOCAL_RANK": str(rank), "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    if launcher == "pmi":
        return {"PMI_RANK": str(rank), "PMI_SIZE": "2", "MPI_LOCALRANKID": str(rank), "MPI_LOCALNRANKS": "2"}
    if launcher == "mvapich":
        return {"MV2_COMM_WORLD_RANK": str(rank), "MV2_COMM_WORLD_SIZE": "2",
                "MV2_COMM_WORLD_LOCAL_RANK": str(rank), "MV2_COMM_WORLD_LOCAL_SIZE": "2"}
    # srun -n 2 on one node, with the job's variables an allocation of 4 tasks also sets
    return {"SLURM_PROCID": str(rank), "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "4",
            "SLURM_LOCALID": str(rank), "SLURM_STEP_TASKS_PER_NODE": "2",
            "SLURM_STEP_NODELIST": "127.0.0.[1-2]", "SLURM_NODELIST": "elsewhere[1-2]"}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _run_two_ranks(launcher: str, entry: str) -> tuple[list[dict], int]:
    port = _free_port()
    base = {name: value for name, value in os.environ.items() if name not in TORCHRUN_NAMES}
    base["SHARDWISE_COLLECTIVE_TIMEOUT"] = "60"
    if entry == "initialize":
        base["MASTER_PORT"] = str(port)  # a job script's export, kept as it is
    processes = [
        subprocess.Popen([sys.executable, "-c", WORKER, entry, str(port)], env={**base, **_launcher_environment(
            launcher, rank)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for rank in range(2)
    ]
    outputs = [process.communicate(timeout=120) for process in processes]
    for process, (_, stderr) in zip(processes, outputs):
        assert process.returncode == 0, stderr
    return [json.loads(stdout.strip().splitlines()[-1]) for stdout, _ in outputs], port


@pytest.mark.parametrize("launcher", [
    "openmpi", "slurm", pytest.param("pmi", marks=pytest.mark.slow), pytest.param("mvapich", marks=pytest.mark.slow),
])
def test_two_processes_join_through_their_launchers_variables(launcher):
    results, port = _run_two_ranks(launcher, "initialize")
    assert [result["rank"] for result in results] == [0, 1]
    assert [result["local_rank"] for result in results] == ["0", "1"]
    for result in results:
        assert result["world_size"] == 2 and result["sum"] == 3.0
        assert result["master"] == f"127.0.0.1:{port}"


@pytest.mark.parametrize("launcher", ["openmpi", pytest.param("slurm", marks=pytest.mark.slow)])
def test_deepspeed_init_distributed_discovers_the_ranks_on_distributed_port(launcher):
    results, port = _run_two_ranks(launcher, "deepspeed")
    assert [result["rank"] for result in results] == [0, 1]
    for result in results:
        assert result["world_size"] == 2 and result["sum"] == 3.0
        assert result["master"] == f"127.0.0.1:{port}"  # DeepSpeed's distributed_port


def test_torchrun_variables_win_over_every_other_launchers():
    assert torchrun_variables({"RANK": "1", "WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0",
                               "OMPI_COMM_WORLD_SIZE": "2"}) == {}
    assert torchrun_variables({"PATH": "/bin"}) == {}


def test_mpirun_inside_a_slurm_allocation_takes_the_ranks_from_mpi():
    environ = {**_launcher_environment("openmpi", 1), "SLURM_PROCID": "0", "SLURM_NTASKS": "2",
               "SLURM_NODELIST": "node[1-2]"}
    assert torchrun_variables(environ) == {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
                                           "LOCAL_WORLD_SIZE": "2", "MASTER_PORT": "29500",
                                           "MASTER_ADDR": "127.0.0.1"}


def test_slurm_on_several_nodes_takes_rank_0s_host_from_the_step_node_list():
    environ = {"SLURM_PROCID": "5", "SLURM_STEP_NUM_TASKS": "8", "SLURM_LOCALID": "1",
               "SLURM_STEP_TASKS_PER_NODE": "2(x4)", "SLURM_STEP_NODELIST": "gpu[007-010]",
               "MASTER_PORT": "1234"}
    assert torchrun_variables(environ) == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                                           "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "gpu007"}
    uneven = {**environ, "SLURM_STEP_TASKS_PER_NODE": "3,2(x2)"}
    assert "LOCAL_WORLD_SIZE" not in torchrun_variables(uneven)  # this node's count is not named
    exported = {**environ, "MASTER_ADDR": "head"}
    assert "MASTER_ADDR" not in torchrun_variables(exported)


def test_slurm_without_the_step_count_falls_back_to_the_jobs():
    environ = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NODELIST": "a1"}
    assert torchrun_variables(environ, default_port=7000) == {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                                                              "MASTER_PORT": "7000", "MASTER_ADDR": "a1"}


def test_mpi_on_several_nodes_without_master_addr_is_refused_with_the_fix():
    environ = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
               "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    with pytest.raises(ValueError, match=r"Open MPI started rank 3 of 4 on several nodes .*\(mpirun -x MASTER_ADDR"):
        torchrun_variables(environ)
    assert torchrun_variables({**environ, "MASTER_ADDR": "n0"})["RANK"] == "3"


def test_garbled_variables_are_refused():
    with pytest.raises(ValueError, match=r"PMI_RANK='x' is not a non-negative integer"):
        torchrun_variables({"PMI_RANK": "x", "PMI_SIZE": "2", "MASTER_ADDR": "h"})


@pytest.mark.parametrize(("nodelist", "host"), [
    ("node1", "node1"), ("gpu[03-05,9],login1", "gpu03"), ("a1,b[1-2]", "a1"), ("rack[2-3]-n[01-04]", "rack2-n01"),
    ("x[5,7]", "x5"),
])
def test_first_host_of_a_slurm_node_list(nodelist, host):
    assert first_host(nodelist) == host


def test_a_node_list_that_is_not_one_is_refused():
    with pytest.raises(ValueError, match="cannot read the first host"):
        first_host("gpu[1-2")
