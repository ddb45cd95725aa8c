"""The torchrun variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT) from what other launchers set: Open MPI's `mpirun`, MPICH / Intel MPI's
Hydra (`PMI_*`), MVAPICH, and SLURM's `srun`.

A job script written for a cluster starts one process per rank with one of these and
never runs torchrun, so `init_process_group("env://")` would find nothing to read. This
translates their variables once, before the group is created; a process started by
torchrun (RANK and WORLD_SIZE set) is left alone. MPI launchers come before SLURM because
`mpirun` inside a SLURM allocation inherits the allocation's SLURM variables, which then
describe the batch step, not the ranks.

The master is rank 0's host. SLURM names the step's nodes (`SLURM_STEP_NODELIST`), and
rank 0 runs on the first; MPI launchers name none, so a job on several nodes must set
MASTER_ADDR itself (`mpirun -x MASTER_ADDR=...`), and a job on one node uses loopback.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

DEFAULT_MASTER_PORT = 29500  # torchrun's and DeepSpeed's
LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class _Launcher:
    """Which variables one launcher sets for rank, world size, local rank and local size."""

    name: str
    rank: str
    world_size: str
    local_rank: str
    local_world_size: str
    world_size_fallback: str | None = None  # read when `world_size` is not set
    node_list: str | None = None  # names the nodes, rank 0's first; tasks per node as "2(x3),1"


# Checked in this order; the first whose rank and world size are both set wins.
_LAUNCHERS = (
    _Launcher("Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
              "OMPI_COMM_WORLD_LOCAL_SIZE"),
    _Launcher("MVAPICH", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK",
              "MV2_COMM_WORLD_LOCAL_SIZE"),
    _Launcher("MPICH / Intel MPI (PMI)", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    # srun sets SLURM_STEP_NUM_TASKS for the step it starts; SLURM_NTASKS is the job's,
    # read for a step started before srun exported the step's own count.
    _Launcher("SLURM", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID", "SLURM_STEP_TASKS_PER_NODE",
              world_size_fallback="SLURM_NTASKS", node_list="SLURM_STEP_NODELIST"),
)


def torchrun_variables(environ: Mapping[str, str], *, default_port: int = DEFAULT_MASTER_PORT) -> dict[str, str]:
    """The torchrun variables to add to `environ` so that `init_process_group` finds the
    job a launcher other than torchrun started; empty when torchrun's are already there
    or no known launcher's are. Variables already set (a MASTER_ADDR the job script
    exported) are kept. Raises ValueError when the job spans nodes and nothing names
    rank 0's host."""
    if "RANK" in environ and "WORLD_SIZE" in environ:
        return {}
    launcher = next((each for each in _LAUNCHERS if each.rank in environ and _world_size(each, environ)), None)
    if launcher is None:
        return {}
    world_size = _world_size(launcher, environ)
    local_world_size = _local_world_size(launcher, environ)
    found = {
        "RANK": _integer(launcher.rank, environ[launcher.rank]),
        "WORLD_SIZE": world_size,
        "LOCAL_RANK": _integer(launcher.local_rank, environ.get(launcher.local_rank, "0")),
        "MASTER_PORT": str(default_port),
    }
    if local_world_size is not None:
        found["LOCAL_WORLD_SIZE"] = local_world_size
    if "MASTER_ADDR" not in environ:
        found["MASTER_ADDR"] = _master_address(launcher, environ, world_size, local_world_size)
    return {name: value for name, value in found.items() if name not in environ}


def first_host(nodelist: str) -> str:
    """The first host of a SLURM hostlist expression: `gpu[03-05,9],login1` -> `gpu03`.

    Only the first item before a top-level comma matters, and in each bracket of it only
    the first number (zero padding kept)."""
    item = re.split(r",(?![^\[]*\])", nodelist.strip(), maxsplit=1)[0]
    host = re.sub(r"\[([^\]]*)\]", lambda ranges: re.split(r"[-,]", ranges.group(1))[0], item)
    if not host or "[" in host or "]" in host:
        raise ValueError(f"cannot read the first host of the SLURM node list {nodelist!r}")
    return host


def _world_size(launcher: _Launcher, environ: Mapping[str, str]) -> str | None:
    name = launcher.world_size
    if name not in environ and launcher.world_size_fallback is not None:
        name = launcher.world_size_fallback
    return _integer(name, environ[name]) if name in environ else None


def _local_world_size(launcher: _Launcher, environ: Mapping[str, str]) -> str | None:
    text = environ.get(launcher.local_world_size)
    if text is None:
        return None
    if launcher.node_list is not None:
        # "2(x3),1": tasks per node, node by node; this node's count is not named, so it
        # is known only when every node runs the same number of tasks.
        counts = {match.group(1) for match in re.finditer(r"(\d+)(?:\(x\d+\))?", text)}
        return counts.pop() if len(counts) == 1 else None
    return _integer(launcher.local_world_size, text)


def _master_address(launcher: _Launcher, environ: Mapping[str, str], world_size: str,
                    local_world_size: str | None) -> str:
    if launcher.node_list is not None:
        nodelist = environ.get(launcher.node_list) or environ.get("SLURM_NODELIST") or environ.get(
            "SLURM_JOB_NODELIST")
        if nodelist:
            return first_host(nodelist)
    if local_world_size == world_size:
        return LOOPBACK
    raise ValueError(
        f"{launcher.name} started rank {environ[launcher.rank]} of {world_size} on several nodes but names no "
        "host for rank 0: set MASTER_ADDR to rank 0's host for every rank (mpirun -x MASTER_ADDR=<host>, "
        "or export it before srun)"
    )


def _integer(name: str, text: str) -> str:
    if not text.strip().isdigit():
        raise ValueError(f"{name}={text!r} is not a non-negative integer; the launcher's variables are garbled")
    return str(int(text))
