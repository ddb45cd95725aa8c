"""Elastic training (issue 30 item 3): a node lost mid-run, the job finishes on the rest.

Four `shardwise run` agents (one process each) meet at a c10d rendezvous with `--nnodes
2:4 --max-restarts 1`, as four nodes would. After step 5 the last agent's worker kills its
own launcher (a node lost). The first agent hosts the rendezvous store, as the node at
`--rdzv-endpoint` does on a cluster: torchrun's c10d rendezvous does not survive losing
that node (an etcd rendezvous would), so the node lost is another.
The others fail in their next collective, torchrun restarts them at the three nodes left,
and `auto_resume` makes `initialize` load the newest checkpoint (step 4, written by four
ranks at ZeRO-3) resharded to three, with the global batch kept (accumulation 3 -> 4).
The reference is the same script started by hand with three processes from a copy of the
step-4 checkpoint: the steps after the restart must equal it.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.tools.launcher.test_launcher import ENV, SHARDWISE

WORKER = Path(__file__).with_name("elastic_worker.py")
STEPS, KILL_AFTER = 8, 5


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start(command: list[str], cwd: Path, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for_listener(port: int, agent: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and agent.poll() is None:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise AssertionError(f"the first agent never listened on {port}: {agent.poll()=}")


def losses(out: Path) -> list[dict]:
    """Rank 0's log: every step it ran, in order."""
    return [json.loads(line) for line in (out / "rank0.jsonl").read_text().splitlines()]


def test_a_lost_node_restarts_the_job_on_the_rest_from_its_checkpoint(tmp_path):
    out, ckpt = tmp_path / "elastic", tmp_path / "ckpt"
    out.mkdir()
    port = free_port()
    command = [*SHARDWISE, "--nproc", "1", "--nnodes", "2:4", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-id", "elastic-test", "--max-restarts", "1", "--rdzv-conf", "last_call_timeout=2",
               str(WORKER), str(out), str(ckpt), str(STEPS)]
    agents = [start(command, tmp_path, ENV)]
    wait_for_listener(port, agents[0])  # the first agent hosts the rendezvous store
    agents += [start(command, tmp_path, {**ENV, "ELASTIC_KILL_AFTER": str(KILL_AFTER) if last else "0"})
               for last in (False, False, True)]
    outputs = []
    try:
        for agent in agents:
            outputs.append(agent.communicate(timeout=300)[0])
    finally:
        for agent in agents:
            agent.kill()
    codes = sorted(agent.returncode for agent in agents)
    assert codes == [-9, 0, 0, 0], "\n".join(outputs)  # the killed node's launcher, the three that finished

    run = losses(out)
    first = [row for row in run if row["restart"] == 0]
    second = [row for row in run if row["restart"] == 1]
    assert [row["step"] for row in first] == [1, 2, 3, 4, 5] and {row["world"] for row in first} == {4}
    assert [row["step"] for row in second] == [5, 6, 7, 8] and {row["world"] for row in second} == {3}

    by_hand, copy = tmp_path / "by-hand", tmp_path / "ckpt-step4"
    by_hand.mkdir()
    copy.mkdir()
    shutil.copytree(ckpt / "step4", copy / "step4")
    (copy / "latest").write_text("step4\n")
    finished = subprocess.run([*SHARDWISE, "--nproc", "3", str(WORKER), str(by_hand), str(copy), str(STEPS)],
                              cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=240)
    assert finished.returncode == 0, finished.stderr
    reference = losses(by_hand)
    assert [row["step"] for row in reference] == [5, 6, 7, 8]
    assert [row["loss"] for row in second] == pytest.approx([row["loss"] for row in reference], rel=1e-6)
    # the lost step 5 was run again from the step-4 weights at the new size: close, not equal
    assert second[0]["loss"] == pytest.approx(first[4]["loss"], rel=1e-4)
