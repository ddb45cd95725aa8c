"""`shardwise run --hostfile` for real: an OpenSSH server on loopback with a generated
key stands for two hosts, 127.0.0.1 and 127.0.0.2, one process each. They must train
ZeRO-3 to the losses one node with 2 processes reaches, and a host that fails must stop
the other. Skipped where no sshd can be started (it is not installed, or this is not
root, which sshd needs to log a user in)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]
SSHD = shutil.which("sshd") or ("/usr/sbin/sshd" if os.path.exists("/usr/sbin/sshd") else None)

TRAIN_ZERO3 = textwrap.dedent(
    """
    import json, os, sys
    import torch
    import shardwise

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3}}
    engine = shardwise.initialize(model, config, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    rank = torch.distributed.get_rank()
    data = torch.randn(3, 8, 8, generator=torch.Generator().manual_seed(1))
    target = data.sum(-1, keepdim=True).sin()
    losses = []
    for step in range(3):  # each rank trains on its half of the global batch of 8
        rows = slice(rank * 4, rank * 4 + 4)
        loss = torch.nn.functional.mse_loss(engine(data[step, rows]), target[step, rows])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    report = {"world_size": torch.distributed.get_world_size(), "node_rank": int(os.environ["GROUP_RANK"]),
              "losses": losses, "forwarded": os.environ.get("PYTHON_FORWARDED"),
              "from_env_file": os.environ.get("FROM_ENV_FILE")}
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as file:
        json.dump(report, file)
    """
)

FAIL_ON_NODE_1 = textwrap.dedent(
    """
    import os, sys, time
    if os.environ["GROUP_RANK"] == "1":
        sys.exit("node 1 fails")
    with open(os.path.join(sys.argv[1], "survivor.pid"), "w") as file:
        file.write(str(os.getpid()))
    time.sleep(600)
    """
)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def ssh_hosts(tmp_path_factory):
    """Options that reach 127.0.0.1 and 127.0.0.2 over ssh, through an sshd of this test."""
    if SSHD is None:
        pytest.skip("no sshd here (install OpenSSH's server, e.g. apt-get install openssh-server)")
    if os.geteuid() != 0:
        pytest.skip("sshd must run as root to log a user in")
    directory = tmp_path_factory.mktemp("sshd")
    for key in ("host_key", "user_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(directory / key)], check=True)
    shutil.copy(directory / "user_key.pub", directory / "authorized_keys")
    port = _free_port()
    (directory / "sshd_config").write_text(textwrap.dedent(f"""\
        Port {port}
        ListenAddress 127.0.0.1
        ListenAddress 127.0.0.2
        HostKey {directory}/host_key
        AuthorizedKeysFile {directory}/authorized_keys
        PidFile {directory}/sshd.pid
        StrictModes no
        UsePAM no
        PasswordAuthentication no
        PermitRootLogin prohibit-password
        """))
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
    log = directory / "sshd.log"
    server = subprocess.Popen([SSHD, "-D", "-E", str(log), "-f", str(directory / "sshd_config")],
                              stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    options = (f"-i {directory}/user_key -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null "
               "-o BatchMode=yes -o LogLevel=ERROR")
    try:
        for _ in range(50):
            reached = subprocess.run(["ssh", "-p", str(port), *options.split(), "127.0.0.2", "true"],
                                     capture_output=True, timeout=30)
            if reached.returncode == 0 or server.poll() is not None:
                break
            time.sleep(0.2)
        if server.poll() is not None or reached.returncode != 0:
            pytest.skip(f"could not start or reach an sshd on loopback: {log.read_text() if log.exists() else ''}"
                        f"{reached.stderr.decode()}")
        yield ["--ssh_port", str(port), f"--launcher_args={options}"]
    finally:
        server.terminate()
        server.wait(timeout=30)


def shardwise_run(argv: list[str], cwd: Path, **kwargs) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHON_FORWARDED": "yes it is",
                   "SHARDWISE_COLLECTIVE_TIMEOUT": "120"}
    return subprocess.run([sys.executable, "-m", "shardwise.tools.cli.main", "run", *argv], cwd=cwd,
                          env=environment, capture_output=True, text=True, **kwargs)


def reports(directory: Path) -> list[dict]:
    return [json.loads((directory / f"rank{rank}.json").read_text()) for rank in range(2)]


def test_two_hosts_over_ssh_train_zero3_to_the_losses_of_one_node(ssh_hosts, tmp_path):
    (tmp_path / "train.py").write_text(TRAIN_ZERO3)
    (tmp_path / "hosts").write_text("127.0.0.1 slots=1\n127.0.0.2 slots=1\n")
    (tmp_path / ".deepspeed_env").write_text("FROM_ENV_FILE=$SHELL:x\n")  # expanded on the host
    (tmp_path / "one_node").mkdir(), (tmp_path / "two_hosts").mkdir()

    one = shardwise_run(["--nproc", "2", "train.py", "one_node"], tmp_path, timeout=300)
    assert one.returncode == 0, one.stderr
    two = shardwise_run(["--hostfile", "hosts", "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
                         *ssh_hosts, "train.py", "two_hosts"], tmp_path, timeout=300)
    assert two.returncode == 0, two.stdout + two.stderr

    reference, hosts = reports(tmp_path / "one_node"), reports(tmp_path / "two_hosts")
    assert [report["node_rank"] for report in hosts] == [0, 1]
    for expected, got in zip(reference, hosts):
        assert got["world_size"] == 2
        assert got["losses"] == pytest.approx(expected["losses"], rel=1e-5)
        assert got["forwarded"] == "yes it is"  # PYTHON* is forwarded
        assert got["from_env_file"].endswith(":x") and not got["from_env_file"].startswith("$")


@pytest.mark.slow  # about 20 s: a launch over ssh and the stop
def test_a_failing_host_stops_the_others(ssh_hosts, tmp_path):
    (tmp_path / "fail.py").write_text(FAIL_ON_NODE_1)
    (tmp_path / "hosts").write_text("127.0.0.1 slots=1\n127.0.0.2 slots=1\n")
    started = time.monotonic()
    ran = shardwise_run(["--hostfile", "hosts", "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
                         *ssh_hosts, "fail.py", str(tmp_path)], tmp_path, timeout=300)
    assert ran.returncode == 1, ran.stdout + ran.stderr
    assert "node 1 (127.0.0.2) failed with exit status 1; stopped 1 other host(s)" in ran.stderr
    assert time.monotonic() - started < 120  # not the survivor's 600 s
    survivor = int((tmp_path / "survivor.pid").read_text())
    for _ in range(100):
        if not Path(f"/proc/{survivor}").exists():
            break
        time.sleep(0.1)
    assert not Path(f"/proc/{survivor}").exists(), "node 0's worker outlived the failed job"
