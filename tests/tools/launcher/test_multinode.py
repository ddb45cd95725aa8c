"""The commands `shardwise run --hostfile` starts: each host's `shardwise run`, the pdsh,
srun and mpirun lines as DeepSpeed builds them, and the environment forwarded."""

from __future__ import annotations

import argparse
import shlex
import sys

import pytest

from shardwise.tools.launcher.cli import add_parser, main
from shardwise.tools.launcher.forwarded_environment import export_commands, forwarded_variables
from shardwise.tools.launcher.hosts import plan_hosts
from shardwise.tools.launcher.multinode import Job, mpirun_command, node_command, pdsh_command, srun_command


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="shardwise")
    add_parser(parser.add_subparsers())
    return parser.parse_args(["run", *argv])


def job(hosts: dict[str, list[int]], **changes) -> Job:
    fields = dict(hosts=hosts, master_addr="10.0.0.1", master_port=29500, script="/w/train.py",
                  script_args=["--lr", "0.1 x"], exports={"PYTHONPATH": "/w", "NCCL_DEBUG": "INFO"}, cwd="/w",
                  node_options=[], launcher_args=[])
    return Job(**{**fields, **changes})


def test_each_host_runs_shardwise_run_with_its_node_rank_and_slots():
    command = node_command(job({"a": [0, 1], "b": [1, 3]}), "b", 1)
    assert command.startswith("export PYTHONPATH=/w; export NCCL_DEBUG=INFO; export CUDA_VISIBLE_DEVICES=1,3; "
                              "cd /w; exec ")
    assert shlex.split(command.split("exec ", 1)[1]) == [
        sys.executable, "-u", "-m", "shardwise.tools.cli.main", "run", "--nproc", "2", "--nnodes", "2",
        "--node-rank", "1", "--rdzv-endpoint", "10.0.0.1:29500", "/w/train.py", "--lr", "0.1 x",
    ]


def test_pdsh_puts_each_hosts_rank_in_and_needs_the_same_slots_everywhere():
    command = pdsh_command(job({"a": [0, 1], "b": [0, 1]}, launcher_args=["-R", "ssh"]))
    assert command[:7] == ["pdsh", "-S", "-f", "1024", "-w", "a,b", "-R"]
    assert "--node-rank %n --rdzv-endpoint" in command[-1]
    with pytest.raises(ValueError, match="select the same slots on every host .* or use --launcher ssh"):
        pdsh_command(job({"a": [0, 1], "b": [0]}))


def test_srun_line_is_deepspeeds():
    exports = {"PYTHONPATH": "/w", "MY": "a b"}
    assert srun_command(job({"a": [0, 1], "b": [0, 1]}, exports=exports, launcher_args=["-p", "gpu"]),
                        filtered=True, num_nodes=-1, num_gpus=-1) == [
        "srun", "-n", "4", "-p", "gpu", "--nodelist", "a,b", "--nodes", "2", '--export=ALL,PYTHONPATH=/w,MY="a b"',
        sys.executable, "-u", "/w/train.py", "--lr", "0.1 x",
    ]
    assert srun_command(job({"a": [0, 1]}, exports={}), filtered=False, num_nodes=1, num_gpus=2)[3:7] == [
        "--nodes", "1", "--gpus-per-node", "2"]


def test_srun_cannot_pick_devices_or_uneven_counts():
    with pytest.raises(ValueError, match=r"slots \[1\] of b cannot be selected"):
        srun_command(job({"a": [0], "b": [1]}), filtered=True, num_nodes=-1, num_gpus=-1)
    with pytest.raises(ValueError, match="same number of tasks on every host"):
        srun_command(job({"a": [0, 1], "b": [0]}), filtered=True, num_nodes=-1, num_gpus=-1)


def test_mpirun_line_is_deepspeeds_with_rank_0s_address():
    assert mpirun_command(job({"a": [0, 1], "b": [0, 1]}, exports={"NCCL_DEBUG": "INFO"}), hostfile="hosts",
                          pool={"a": 2, "b": 2}) == [
        "mpirun", "-n", "4", "-hostfile", "hosts", "--mca", "btl", "^openib", "--mca", "btl_tcp_if_include", "eth0",
        "-x", "UCX_TLS=tcp", "-x", "NCCL_DEBUG=INFO", "-x", "MASTER_ADDR=10.0.0.1", "-x", "MASTER_PORT=29500",
        sys.executable, "-u", "/w/train.py", "--lr", "0.1 x",
    ]


def test_forwarded_environment_is_deepspeeds(tmp_path):
    home, cwd = tmp_path / "home", tmp_path / "work"
    home.mkdir(), cwd.mkdir()
    (home / ".deepspeed_env").write_text("A=home\nB=home\n")
    (cwd / ".deepspeed_env").write_text("# mine\n\nB = $HOME/x \n")
    environ = {"PATH": "/bin", "NCCL_IB_HCA": "mlx5", "UCX_TLS": "rc", "MLFLOW_RUN": "7", "MV2_X": "1",
               "PYTHONHASHSEED": "0", "PYTHONPATH": "/lib", "HOME": str(home)}
    forwarded = forwarded_variables(environ, cwd=cwd, home=home)
    assert forwarded == {"NCCL_IB_HCA": "mlx5", "UCX_TLS": "rc", "MLFLOW_RUN": "7", "MV2_X": "1",
                         "PYTHONHASHSEED": "0", "PYTHONPATH": f"{cwd}:/lib", "A": "home", "B": "$HOME/x"}
    assert export_commands({"B": "$HOME/x", "C": "a,b:c"}) == 'export B="$HOME/x"; export C=a,b:c; '
    aisc = forwarded_variables({**environ, "AISC_JOB_NAME": "j"}, cwd=cwd, home=home)
    assert "NCCL_IB_HCA" not in aisc  # each AISC node sets its own
    (cwd / "other_env").write_text("nonsense\n")
    with pytest.raises(ValueError, match=r"other_env:1: 'nonsense' is not NAME=VALUE"):
        forwarded_variables({"DS_ENV_FILE": "other_env"}, cwd=cwd, home=home)


@pytest.mark.parametrize(("argv", "message"), [
    (["--include", "a"], "--include selects hosts of a hostfile: add --hostfile FILE"),
    (["--launcher", "slurm"], "--launcher selects hosts of a hostfile"),
    (["--hostfile", "HOSTS", "--nproc", "2"], "--nproc comes from the hostfile"),
    (["--hostfile", "HOSTS", "--launcher", "openmpi", "--num_nodes", "1"], "openmpi runs every slot"),
    (["--hostfile", "HOSTS", "--launcher", "slurm", "--as-deepspeed"], "--as-deepspeed needs shardwise's launcher"),
    (["--hostfile", "HOSTS", "--launcher", "pdsh", "--master_addr", "a"], "runs `pdsh`, which is not on PATH"),
])
def test_flags_that_cannot_work_are_refused(argv, message, tmp_path, monkeypatch, capsys):
    (tmp_path / "HOSTS").write_text("a slots=2\nb slots=2\n")
    (tmp_path / "t.py").write_text("")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path))  # no pdsh, srun or mpirun
    assert main(parse([*argv, "t.py"])) == 2
    assert message in capsys.readouterr().err


def test_one_selected_host_runs_here_on_its_slots(tmp_path):
    (tmp_path / "hosts").write_text("a slots=4\nb slots=4\n")
    args = parse(["--hostfile", str(tmp_path / "hosts"), "--include", "b:1,2", "t.py"])
    assert plan_hosts(args) is None
    assert (args.nproc, args.visible_devices) == (2, "1,2")


def test_slurm_launcher_prints_and_runs_the_srun_line(tmp_path, monkeypatch, capsys):
    """SLURM cannot run here: `srun` is a stand-in script that records its arguments and
    exits with status 3, which the launcher must return."""
    (tmp_path / "srun").write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {tmp_path}/argv\nexit 3\n")
    (tmp_path / "srun").chmod(0o755)
    (tmp_path / "hosts").write_text("a slots=2\nb slots=2\nc slots=2\n")
    (tmp_path / "t.py").write_text("")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    assert main(parse(["--hostfile", "hosts", "--launcher", "slurm", "--exclude", "b", "t.py", "x"])) == 3
    printed = capsys.readouterr().err
    assert "shardwise run: srun -n 4 --nodelist a,c --nodes 2 " in printed and "--export=ALL," in printed
    recorded = (tmp_path / "argv").read_text().splitlines()
    assert recorded[:6] == ["-n", "4", "--nodelist", "a,c", "--nodes", "2"]
    assert recorded[-4:] == [sys.executable, "-u", str(tmp_path / "t.py"), "x"]
