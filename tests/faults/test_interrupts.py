"""Interrupted launchers (reliability issue, part 4): `shardwise train` and `shardwise run`
killed with SIGKILL take their workers with them; stopped with SIGINT or SIGTERM they end
with one line on stderr and no traceback, and `shardwise train` first has the ranks agree
on a step and checkpoint it; a second SIGINT ends everything at once.

Every job is a real launcher process with two gloo workers, kept small (the tiny GPT, a
two-line all-reduce script); every wait has a deadline, and whatever a test started is
killed when it ends.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

import shardwise
from shardwise.tools.launcher.lifeline import LAUNCHER_PID_ENV
from shardwise.tools.train.options import TrainOptions
from shardwise.tools.train.setup import build_model

REPO_ROOT = Path(__file__).resolve().parents[2]
# OMP_NUM_THREADS set: torchrun would otherwise warn on stderr that it sets it to 1.
ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
}
START_SECONDS = 60  # a loaded 2-core machine can take this long to start two ranks
EXIT_SECONDS = 30  # torchrun's shutdown timeout: longer means the interrupt was not handled
DEATH_SECONDS = 5  # "promptly"

LOOP_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    with open(os.path.join(sys.argv[1], f"pid{dist.get_rank()}"), "w") as file:
        file.write(str(os.getpid()))
    total = torch.ones(1000)
    while True:
        dist.all_reduce(total)
        time.sleep(0.01 * (dist.get_rank() + 1))
    """
)


def wait_for(condition: Callable[[], object], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {seconds} s")
        time.sleep(0.05)


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def assert_all_die(pids: list[int]) -> None:
    wait_for(lambda: not any(alive(pid) for pid in pids), DEATH_SECONDS, f"workers {pids} exiting")


class Job:
    """A launcher started in the background, and the worker pids found so far."""

    def __init__(self, argv: tuple[str, ...], cwd: Path) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "shardwise.tools.cli.main", *argv],
            cwd=cwd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        self.workers: list[int] = []

    def signal(self, signum: int) -> None:
        self.process.send_signal(signum)

    def finish(self) -> tuple[int, str, str]:
        stdout, stderr = self.process.communicate(timeout=EXIT_SECONDS)
        return self.process.returncode, stdout, stderr

    def workers_started(self, count: int) -> list[int]:
        """The launcher's worker processes: torchrun's agent starts them as its own children."""
        launcher = psutil.Process(self.process.pid)
        wait_for(lambda: len(launcher.children()) == count, START_SECONDS, "workers starting")
        self.workers = [child.pid for child in launcher.children()]
        return self.workers

    def kill_everything(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.communicate(timeout=EXIT_SECONDS)
        for pid in self.workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@contextmanager
def launched(*argv: str, cwd: Path) -> Iterator[Job]:
    """`python -m shardwise.tools.cli.main ARGV` in the background; it and its workers are
    killed on the way out, whatever happened."""
    job = Job(argv, cwd)
    try:
        yield job
    finally:
        job.kill_everything()


# -- shardwise train ----------------------------------------------------------------------


def train_job(tmp_path: Path, *flags: str) -> tuple[tuple[str, ...], Path]:
    argv = ("train", "--model-size", "tiny", "--nproc", "2", "--steps", "1000",
            "--out-dir", str(tmp_path), "--name", "job", *flags)  # fmt: skip
    return argv, tmp_path / "job"


def steps_logged(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def load_step(run_dir: Path, tag: str) -> int:
    """Load the checkpoint into a one-process engine (resharding from two ranks) and
    return the step its client state records."""
    options = TrainOptions.load(run_dir / "options.json")
    model, _ = build_model(options)
    engine = shardwise.initialize(model, options.config)
    try:
        return engine.load_checkpoint(run_dir / "checkpoint", tag=tag)["step"]
    finally:
        engine.destroy()


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_interrupted_train_checkpoints_the_step_the_ranks_agreed_on(tmp_path, stop):
    argv, run_dir = train_job(tmp_path, "--save-every", "2")
    with launched(*argv, cwd=tmp_path) as job:
        workers = job.workers_started(2)
        wait_for(lambda: steps_logged(run_dir) >= 3, START_SECONDS, "three training steps")
        job.signal(stop)
        code, stdout, stderr = job.finish()

    step = steps_logged(run_dir)  # rank 0 logs a step before the ranks act on the signal
    name = signal.Signals(stop).name
    assert code == 128 + stop
    assert stderr.splitlines() == [
        f"shardwise train: interrupted by {name}; partial results are in {run_dir}/ (last checkpoint: step{step})"
    ]
    assert "Traceback" not in stdout + stderr
    assert f"{name}: stopping after step {step} and writing checkpoint step{step}" in stdout
    assert_all_die(workers)
    checkpoint = run_dir / "checkpoint"
    assert (checkpoint / "latest").read_text().strip() == f"step{step}"
    tags = sorted(path.name for path in checkpoint.iterdir() if path.name.startswith("step"))
    assert tags == sorted({f"step{s}" for s in range(2, step, 2)} | {f"step{step}"})
    assert load_step(run_dir, f"step{step}") == step


def test_a_second_sigint_ends_train_at_once_even_with_ranks_that_cannot_finish(tmp_path):
    """The ranks are frozen (SIGSTOP) so they cannot act on the first SIGINT; without the
    second one the launcher would wait torchrun's 30 s shutdown timeout for them."""
    argv, run_dir = train_job(tmp_path)
    with launched(*argv, cwd=tmp_path) as job:
        workers = job.workers_started(2)
        wait_for(lambda: steps_logged(run_dir) >= 1, START_SECONDS, "a training step")
        for pid in workers:
            os.kill(pid, signal.SIGSTOP)
        job.signal(signal.SIGINT)
        time.sleep(0.5)
        started = time.monotonic()
        job.signal(signal.SIGINT)
        code, stdout, stderr = job.finish()
        seconds = time.monotonic() - started

    assert seconds < DEATH_SECONDS
    assert code == 130
    assert stderr.splitlines() == [
        f"shardwise train: interrupted by SIGINT; partial results are in {run_dir}/ (no checkpoint written)"
    ]
    assert "Traceback" not in stdout + stderr
    assert_all_die(workers)


def test_killing_train_kills_its_ranks(tmp_path):
    argv, run_dir = train_job(tmp_path)
    with launched(*argv, cwd=tmp_path) as job:
        workers = job.workers_started(2)
        wait_for(lambda: steps_logged(run_dir) >= 1, START_SECONDS, "a training step")
        job.signal(signal.SIGKILL)
        assert_all_die(workers)


# -- shardwise run ------------------------------------------------------------------------


def started_script(tmp_path: Path) -> tuple[Path, Path]:
    script = tmp_path / "loop.py"
    script.write_text(LOOP_SCRIPT)
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    return script, pid_dir


def script_pids(job: Job, pid_dir: Path) -> list[int]:
    """The pids the script's ranks wrote once their process group was up."""
    wait_for(lambda: len(list(pid_dir.glob("pid*"))) == 2, START_SECONDS, "both ranks joining")
    wait_for(lambda: all(path.read_text() for path in pid_dir.glob("pid*")), 5, "pid files written")
    job.workers = [int(path.read_text()) for path in sorted(pid_dir.glob("pid*"))]
    return job.workers


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_interrupted_run_stops_its_workers_and_says_so_in_one_line(tmp_path, stop):
    script, pid_dir = started_script(tmp_path)
    with launched("run", "--nproc", "2", str(script), str(pid_dir), cwd=tmp_path) as job:
        workers = script_pids(job, pid_dir)
        job.signal(stop)
        code, stdout, stderr = job.finish()

    name = signal.Signals(stop).name
    assert code == 128 + stop
    assert stderr.splitlines() == [f"shardwise run: interrupted by {name}; stopped every worker of {script}"]
    assert "Traceback" not in stdout + stderr
    assert_all_die(workers)


def test_killing_run_kills_the_scripts_processes(tmp_path):
    script, pid_dir = started_script(tmp_path)
    with launched("run", "--nproc", "2", str(script), str(pid_dir), cwd=tmp_path) as job:
        workers = script_pids(job, pid_dir)
        assert {psutil.Process(pid).ppid() for pid in workers} == {job.process.pid}  # no process in between
        job.signal(signal.SIGKILL)
        assert_all_die(workers)


# -- the worker's side of the lifeline ----------------------------------------------------


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_worker_whose_launcher_is_already_gone_kills_itself(tmp_path):
    """The race the parent check closes: the launcher died before the death signal was set."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=EXIT_SECONDS)
    code = "from shardwise.tools.launcher.lifeline import die_with_launcher; die_with_launcher(); print('alive')"
    orphan = subprocess.run(
        [sys.executable, "-c", code], env={**ENV, LAUNCHER_PID_ENV: str(gone.pid)},
        capture_output=True, text=True, timeout=EXIT_SECONDS,
    )  # fmt: skip
    assert orphan.returncode == -signal.SIGKILL and orphan.stdout == ""
    child = subprocess.run(
        [sys.executable, "-c", code], env={**ENV, LAUNCHER_PID_ENV: str(os.getpid())},
        capture_output=True, text=True, timeout=EXIT_SECONDS,
    )  # fmt: skip
    assert child.returncode == 0 and child.stdout == "alive\n"
