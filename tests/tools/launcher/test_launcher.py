"""`shardwise run`: flag translation to torchrun, and real launches of tiny gloo scripts."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.distributed.run import parse_args as parse_torchrun_args

from shardwise.tools.launcher.cli import add_parser, build_torchrun_args, main, resolve_nproc

REPO_ROOT = Path(__file__).resolve().parents[3]

ALL_REDUCE_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    report = {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "node_rank": int(os.environ["GROUP_RANK"]),
        "sum": total.item(),
        "argv": sys.argv[2:],
    }
    with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json"), "w") as file:
        json.dump(report, file)
    dist.destroy_process_group()
    """
)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="shardwise")
    add_parser(parser.add_subparsers())
    return parser.parse_args(["run", *argv])


def test_single_node_uses_a_standalone_rendezvous_on_a_free_port():
    args = parse(["--nproc", "3", "train.py", "--lr", "0.1"])
    torchrun_args = build_torchrun_args(args)

    assert torchrun_args == ["--nproc-per-node", "3", "--nnodes", "1", "--standalone", "train.py"]
    config = parse_torchrun_args(torchrun_args)
    assert (config.nproc_per_node, config.nnodes, config.standalone) == ("3", "1", True)
    assert config.training_script == "train.py"


def test_master_port_pins_the_single_node_rendezvous_port():
    torchrun_args = build_torchrun_args(parse(["--nproc", "2", "--master-port", "29555", "train.py"]))

    assert torchrun_args == [
        "--nproc-per-node", "2", "--nnodes", "1",
        "--master-addr", "127.0.0.1", "--master-port", "29555", "train.py",
    ]  # fmt: skip
    config = parse_torchrun_args(torchrun_args)
    assert (config.rdzv_backend, config.master_port, config.standalone) == ("static", 29555, False)


def test_multi_node_meets_at_the_c10d_endpoint():
    args = parse(
        ["--nproc", "8", "--nnodes", "2:4", "--rdzv-endpoint", "node0:29400", "--rdzv-id", "job7", "t.py"]
    )
    torchrun_args = build_torchrun_args(args)

    assert torchrun_args == [
        "--nproc-per-node", "8", "--nnodes", "2:4",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", "node0:29400", "--rdzv-id", "job7", "t.py",
    ]  # fmt: skip
    config = parse_torchrun_args(torchrun_args)
    assert (config.rdzv_backend, config.rdzv_endpoint, config.rdzv_id) == ("c10d", "node0:29400", "job7")


def test_node_rank_switches_to_the_static_rendezvous_hosted_by_node_zero():
    args = parse(
        ["--nproc", "4", "--nnodes", "3", "--node-rank", "2", "--rdzv-endpoint", "10.0.0.1:29400", "t.py"]
    )
    torchrun_args = build_torchrun_args(args)

    assert torchrun_args == [
        "--nproc-per-node", "4", "--nnodes", "3",
        "--rdzv-backend", "static", "--rdzv-endpoint", "10.0.0.1:29400", "--node-rank", "2", "t.py",
    ]  # fmt: skip
    config = parse_torchrun_args(torchrun_args)
    assert (config.rdzv_backend, config.node_rank) == ("static", 2)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nnodes", "2", "t.py"], "--nnodes 2 needs --rdzv-endpoint HOST:PORT"),
        (["--node-rank", "1", "t.py"], "--nnodes 1 with --node-rank 1 needs --rdzv-endpoint HOST:PORT"),
        (["--nnodes", "2", "--master-port", "29500", "t.py"], "--master-port is for a single node"),
        (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1", "t.py"], "--node-rank 2 is out of range"),
        (["--nnodes", "1:2", "--node-rank", "0", "--rdzv-endpoint", "h:1", "t.py"], "needs a fixed --nnodes, got 1:2"),
    ],
)
def test_flag_combinations_that_cannot_work_are_rejected(argv, message):
    with pytest.raises(ValueError, match=message):
        build_torchrun_args(parse(["--nproc", "1", *argv]))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nnodes", "3:2", "t.py"], "expected 1 <= MIN <= MAX, got '3:2'"),
        (["--nnodes", "two", "t.py"], "expected N or MIN:MAX with positive integers, got 'two'"),
        (["--nproc", "0", "t.py"], "expected a positive integer, got '0'"),
        (["--rdzv-endpoint", "node0", "t.py"], "expected HOST:PORT, got 'node0'"),
        (["--master-port", "70000", "t.py"], "expected a port in 1..65535, got '70000'"),
    ],
)
def test_malformed_values_are_rejected_by_the_parser(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse(argv)
    assert message in capsys.readouterr().err


def test_everything_after_the_script_belongs_to_the_script():
    args = parse(["--nproc", "2", "train.py", "--nproc", "5", "--n", "1", "-h", "--master-port=1"])

    assert args.nproc == 2
    assert args.master_port is None
    assert args.script_args == ["--nproc", "5", "--n", "1", "-h", "--master-port=1"]


def test_nproc_defaults_to_one_per_cuda_device_else_two():
    expected = torch.cuda.device_count() if torch.cuda.is_available() else 2
    assert resolve_nproc(parse(["t.py"])).nproc == expected
    assert resolve_nproc(parse(["--nproc", "5", "t.py"])).nproc == 5


def test_a_missing_script_is_reported_without_starting_anything(tmp_path, capsys):
    assert main(parse(["--nproc", "2", str(tmp_path / "missing.py")])) == 2
    assert f"shardwise run: error: no such script: {tmp_path / 'missing.py'}" in capsys.readouterr().err


# Real launches go through the real entry point in a child process of their own, since
# torchrun's agent installs signal handlers in the process that calls it.
SHARDWISE = [sys.executable, "-m", "shardwise.tools.cli.main", "run"]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}


def run_shardwise(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*SHARDWISE, *argv], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=120)


def read_reports(directory: Path) -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted(directory.glob("rank*.json"))]


def test_launches_two_processes_that_all_reduce_and_get_the_script_arguments_untouched(tmp_path):
    script = tmp_path / "all_reduce.py"
    script.write_text(ALL_REDUCE_SCRIPT)

    finished = run_shardwise(["--nproc", "2", str(script), str(tmp_path), "--nproc", "7", "--lr=0.5"], tmp_path)

    assert finished.returncode == 0, finished.stderr
    reports = read_reports(tmp_path)
    ranks = [(r["rank"], r["local_rank"], r["world_size"], r["sum"]) for r in reports]
    assert ranks == [(0, 0, 2, 3.0), (1, 1, 2, 3.0)]
    assert all(r["argv"] == ["--nproc", "7", "--lr=0.5"] for r in reports)


def test_two_nodes_on_one_machine_meet_at_the_rendezvous_endpoint(tmp_path):
    script = tmp_path / "all_reduce.py"
    script.write_text(ALL_REDUCE_SCRIPT)
    with socket.socket() as probe:  # a free port; the gap before the launcher binds it is tiny
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    endpoint = f"127.0.0.1:{port}"
    argv = ["--nproc", "1", "--nnodes", "2", "--rdzv-endpoint", endpoint, "--rdzv-id", "test", str(script), str(tmp_path)]

    other_node = subprocess.Popen(
        [*SHARDWISE, *argv], cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        this_node = run_shardwise(argv, tmp_path)
        other_output, _ = other_node.communicate(timeout=120)
    finally:
        other_node.kill()

    assert this_node.returncode == 0, this_node.stderr
    assert other_node.returncode == 0, other_output
    reports = read_reports(tmp_path)
    assert [(r["rank"], r["world_size"], r["sum"]) for r in reports] == [(0, 2, 3.0), (1, 2, 3.0)]
    assert sorted(r["node_rank"] for r in reports) == [0, 1]


def test_a_failing_script_makes_the_launcher_fail(tmp_path):
    script = tmp_path / "fails.py"
    # one rank fails: two tracebacks written to one stderr at once would interleave
    script.write_text("import os\nif os.environ['RANK'] == '1':\n    raise RuntimeError('the script failed on purpose')\n")

    finished = run_shardwise(["--nproc", "2", str(script)], tmp_path)

    assert finished.returncode == 1
    # The traceback starts at the script, as `python fails.py` prints it, not in the
    # module each worker starts the script through.
    assert f'Traceback (most recent call last):\n  File "{script}", line 3' in finished.stderr
    assert "RuntimeError: the script failed on purpose" in finished.stderr
    assert "runpy" not in finished.stderr and "child.py" not in finished.stderr
    assert "fails.py FAILED" in finished.stderr


def test_the_script_sees_what_python_would_show_it(tmp_path):
    """sys.argv, sys.path[0], __name__ and __file__ as under `python sub/show.py ...`, though
    every worker starts the script through shardwise.tools.launcher.child."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "show.py").write_text(
        "import json, os, sys\n"
        "seen = {'argv': sys.argv, 'path0': sys.path[0], 'name': __name__, 'file': __file__,\n"
        "        'launcher_pid_left': 'SHARDWISE_LAUNCHER_PID' in os.environ}\n"
        "print('SEEN', json.dumps(seen))\n"
    )

    finished = run_shardwise(["--nproc", "1", "sub/show.py", "--lr", "0.1", "x y"], tmp_path)

    assert finished.returncode == 0, finished.stderr
    (line,) = [line for line in finished.stdout.splitlines() if line.startswith("SEEN ")]
    assert json.loads(line[5:]) == {
        "argv": ["sub/show.py", "--lr", "0.1", "x y"],
        "path0": os.path.realpath(tmp_path / "sub"),
        "name": "__main__",
        "file": "sub/show.py",
        "launcher_pid_left": False,
    }


def test_elastic_restarts_and_rendezvous_settings_reach_torchrun():
    args = parse(["--nproc", "1", "--nnodes", "2:4", "--rdzv-endpoint", "node0:29400", "--max-restarts", "3",
                  "--rdzv-conf", "last_call_timeout=5", "train.py"])
    torchrun_args = build_torchrun_args(args)
    assert torchrun_args[torchrun_args.index("--max-restarts") + 1] == "3"
    assert torchrun_args[torchrun_args.index("--rdzv-conf") + 1] == "last_call_timeout=5"
    assert "--max-restarts" not in build_torchrun_args(parse(["--nproc", "2", "train.py"]))
    with pytest.raises(ValueError, match="--rdzv-conf configures the c10d rendezvous"):
        build_torchrun_args(parse(["--nproc", "2", "--rdzv-conf", "last_call_timeout=5", "train.py"]))
