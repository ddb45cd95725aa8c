"""`shardwise run --hostfile FILE`: start the job on every host of a DeepSpeed hostfile.

With `--launcher ssh` (the default) or `pdsh`, each host runs `shardwise run` itself,
one process per selected slot, with its node rank fixed and node 0 hosting the
rendezvous at --master_addr:--master_port (torchrun's static rendezvous), in this
directory and with the environment DeepSpeed forwards (`forwarded_environment`). ssh
gets a terminal on each host (`-tt`), so that closing the connection hangs the remote
command up: the remote `shardwise run` then stops its workers. That is how every host
is stopped when one fails, or when this launcher is interrupted.

With `--launcher slurm` or `openmpi` the job is one `srun` / `mpirun` line, printed and
run as DeepSpeed builds it: it starts the script once per rank and `initialize` reads the
ranks from the launcher's variables (runtime/distributed/launcher_variables.py).
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shardwise.tools.launcher.forwarded_environment import export_commands, shell_value
from shardwise.tools.launcher.interrupts import Interrupted

LAUNCHERS = ("ssh", "pdsh", "slurm", "openmpi")
PDSH_FAN_OUT = 1024  # DeepSpeed's
STOP_GRACE_SECONDS = 30.0


@dataclass(frozen=True)
class Job:
    """What every launcher needs to know about one multi-node job."""

    hosts: dict[str, list[int]]  # host -> slots, in node-rank order
    master_addr: str
    master_port: int
    script: str
    script_args: list[str]
    exports: dict[str, str]  # forwarded variables, unquoted
    cwd: str
    node_options: list[str]  # `shardwise run` options every node adds (--as-deepspeed)
    launcher_args: list[str]  # given to ssh, pdsh, srun or mpirun

    @property
    def total_processes(self) -> int:
        return sum(len(slots) for slots in self.hosts.values())


def node_command(job: Job, host: str, node_rank: int | str) -> str:
    """The shell command one host runs: exports, `cd`, then `shardwise run` for its slots.
    CUDA_VISIBLE_DEVICES names the selected slots, as DeepSpeed's per-node launcher sets it."""
    slots = job.hosts[host]
    run = [
        sys.executable, "-u", "-m", "shardwise.tools.cli.main", "run",
        "--nproc", str(len(slots)), "--nnodes", str(len(job.hosts)), "--node-rank", str(node_rank),
        "--rdzv-endpoint", f"{job.master_addr}:{job.master_port}", *job.node_options, job.script, *job.script_args,
    ]  # fmt: skip
    quoted = " ".join(part if part == "%n" else shlex.quote(part) for part in run)
    devices = ",".join(str(slot) for slot in slots)
    return (f"{export_commands(job.exports)}export CUDA_VISIBLE_DEVICES={devices}; "
            f"cd {shlex.quote(job.cwd)}; exec {quoted}")


def ssh_commands(job: Job, *, ssh_port: int | None) -> list[list[str]]:
    """One `ssh -tt HOST COMMAND` per host, node ranks in hostfile order."""
    port = ["-p", str(ssh_port)] if ssh_port is not None else []
    return [
        ["ssh", "-tt", *port, *job.launcher_args, host, node_command(job, host, rank)]
        for rank, host in enumerate(job.hosts)
    ]


def pdsh_command(job: Job) -> list[str]:
    """One `pdsh` line for all hosts; pdsh puts each host's rank where the command says
    `%n`, so every host must run the same number of processes on the same slots."""
    layouts = {tuple(slots) for slots in job.hosts.values()}
    if len(layouts) > 1:
        raise ValueError(
            f"pdsh runs one command on every host, but the hosts use different slots "
            f"({ {host: slots for host, slots in job.hosts.items()} }): select the same slots on every host "
            "(--num_gpus N), or use --launcher ssh"
        )
    first = next(iter(job.hosts))
    return ["pdsh", "-S", "-f", str(PDSH_FAN_OUT), "-w", ",".join(job.hosts), *job.launcher_args,
            node_command(job, first, "%n")]


def srun_command(job: Job, *, filtered: bool, num_nodes: int, num_gpus: int) -> list[str]:
    """DeepSpeed's srun line: one task per selected slot, every host given the same
    count of the first slots, the filtered hosts named, the exports added to ALL."""
    for host, slots in job.hosts.items():
        if slots != list(range(len(slots))):
            raise ValueError(f"srun places tasks by count, not by device: slots {slots} of {host} cannot be "
                             "selected; filter whole hosts, or keep the first N slots of every host")
    counts = {host: len(slots) for host, slots in job.hosts.items()}
    if len(set(counts.values())) > 1:
        raise ValueError(f"srun starts the same number of tasks on every host, got {counts}")
    command = ["srun", "-n", str(job.total_processes), *job.launcher_args]
    if filtered:
        command += ["--nodelist", ",".join(job.hosts), "--nodes", str(len(job.hosts))]
    if num_nodes > 0:
        command += ["--nodes", str(num_nodes)]
    if num_gpus > 0:
        command += ["--gpus-per-node", str(num_gpus)]
    exports = "".join(f",{name}={shell_value(value)}" for name, value in job.exports.items())
    return [*command, f"--export=ALL{exports}", sys.executable, "-u", job.script, *job.script_args]


def mpirun_command(job: Job, *, hostfile: str, pool: Mapping[str, int]) -> list[str]:
    """DeepSpeed's Open MPI line (every slot of the hostfile), plus MASTER_ADDR and
    MASTER_PORT: DeepSpeed's ranks find rank 0 through mpi4py, shardwise's through these."""
    command = ["mpirun", "-n", str(sum(pool.values())), "-hostfile", hostfile, "--mca", "btl", "^openib"]
    if not any(option == "btl_tcp_if_include" for option in job.launcher_args):
        command += ["--mca", "btl_tcp_if_include", "eth0"]
    command += job.launcher_args
    exports = {"UCX_TLS": "tcp", **job.exports, "MASTER_ADDR": job.master_addr, "MASTER_PORT": str(job.master_port)}
    for name, value in exports.items():
        command += ["-x", f"{name}={value}"]
    return [*command, sys.executable, "-u", job.script, *job.script_args]


def require_program(program: str, launcher: str) -> None:
    if shutil.which(program) is None:
        raise ValueError(f"--launcher {launcher} runs `{program}`, which is not on PATH here")


def run_one(command: Sequence[str]) -> int:
    """Print a launcher line as DeepSpeed logs it, run it, and return its exit status;
    an interrupt is passed on to it."""
    print(f"shardwise run: {shlex.join(command)}", file=sys.stderr, flush=True)
    process = subprocess.Popen(list(command))
    try:
        return process.wait()
    except Interrupted:
        _stop([process])
        raise


def run_all(commands: Sequence[Sequence[str]], hosts: Sequence[str]) -> int:
    """Run one command per host until all succeed, or one fails: then stop the others and
    return the failed host's status. An interrupt stops them all and propagates."""
    processes = [subprocess.Popen(list(command), stdin=subprocess.DEVNULL) for command in commands]
    try:
        while True:
            statuses = [process.poll() for process in processes]
            failed = next((index for index, status in enumerate(statuses) if status not in (None, 0)), None)
            if failed is not None:
                running = [process for process in processes if process.poll() is None]
                _stop(running)
                stopped = f"; stopped {len(running)} other host(s)" if running else ""
                print(f"shardwise run: node {failed} ({hosts[failed]}) failed with exit status "
                      f"{statuses[failed]}{stopped}", file=sys.stderr, flush=True)
                return statuses[failed]
            if all(status == 0 for status in statuses):
                return 0
            time.sleep(0.2)
    except Interrupted:
        _stop([process for process in processes if process.poll() is None])
        raise


def _stop(processes: Sequence[subprocess.Popen]) -> None:
    """End the local ssh clients: the remote commands get a hangup and stop their workers."""
    for process in processes:
        process.terminate()
    deadline = time.monotonic() + STOP_GRACE_SECONDS
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
