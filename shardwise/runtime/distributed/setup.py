"""Join (or start) the process group the way `torchrun` users expect.

`initialize` must work in four situations without the user doing anything: launched by
`torchrun`/`shardwise run` (RANK, WORLD_SIZE, MASTER_ADDR... in the environment), by
`srun` or `mpirun` (their variables translated by `launcher_variables`), inside a
program that already called `init_process_group` (tests, notebooks, other frameworks), and
as a plain single process (no environment at all: no process group, world size 1).
"""

from __future__ import annotations

import atexit
import datetime
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardwise.runtime.distributed.group_cache import shared_groups
from shardwise.runtime.distributed.launcher_variables import torchrun_variables
from shardwise.runtime.distributed.mesh import GroupHandle
from shardwise.runtime.distributed.retired_works import keep_past_exit

DEFAULT_TIMEOUT_SECONDS = 600.0
CALL_CHECK_SECONDS = 120.0
TIMEOUT_ENV = "SHARDWISE_COLLECTIVE_TIMEOUT"


@dataclass(frozen=True)
class DistributedContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    group: dist.ProcessGroup | None  # None when world_size == 1 and no group exists
    timeout: datetime.timedelta

    @property
    def backend(self) -> str:
        return "none" if self.group is None else dist.get_backend(self.group)


def collective_timeout() -> datetime.timedelta:
    """Timeout of every collective, from SHARDWISE_COLLECTIVE_TIMEOUT (seconds)."""
    text = os.environ.get(TIMEOUT_ENV)
    if text is None:
        return datetime.timedelta(seconds=DEFAULT_TIMEOUT_SECONDS)
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(
            f"{TIMEOUT_ENV}={text!r} is not a timeout: give a positive number of seconds "
            f"(default {DEFAULT_TIMEOUT_SECONDS:g})"
        )
    return datetime.timedelta(seconds=seconds)


def call_check_timeout(timeout: datetime.timedelta) -> datetime.timedelta:
    """How long a collective API call (save_checkpoint, load_checkpoint) waits for every
    rank to enter it before saying some rank did not: a fifth of the collective timeout,
    at most two minutes, since ranks reach such calls within a step of each other."""
    return min(timeout / 5, datetime.timedelta(seconds=CALL_CHECK_SECONDS))


def world_handle(context: DistributedContext) -> GroupHandle:
    """All ranks as one group, with a control group of its own: start-up agreement and the
    checks that every rank enters a collective API call use it and nothing else, so they
    can never pair with another operation's collective. Built once and shared by the
    process's engines (group_cache.py)."""
    ranks = tuple(range(context.world_size))
    if context.group is None or context.world_size == 1:
        return GroupHandle("world", ranks, context.rank, context.group, None)
    control = shared_groups(("world control", context.timeout),
                            lambda: dist.new_group(backend="gloo", timeout=context.timeout))
    return GroupHandle("world", ranks, context.rank, context.group, control)


def _pick_device(local_rank: int) -> torch.device:
    """GPU `local_rank` when CUDA is available, else the CPU. Each process needs a GPU of
    its own: NCCL refuses two ranks on one device ("Duplicate GPU detected") only once
    their first collective runs, deep in start-up, so a node given more processes than
    it has GPUs is refused here, with the counts."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    gpus = torch.cuda.device_count()
    if gpus == 1 and os.environ.get("CUDA_VISIBLE_DEVICES"):
        # one GPU per process, bound by the launcher (SLURM's --gpus-per-task, a job script
        # setting CUDA_VISIBLE_DEVICES per rank): every rank's GPU is its device 0. Ranks
        # given the same GPU this way are caught when ranks compare GPU identities
        # (distributed/agreement.py).
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)
    per_node = os.environ.get("LOCAL_WORLD_SIZE", "")
    processes = int(per_node) if per_node.isdigit() else local_rank + 1
    if processes > gpus or local_rank >= gpus:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        shown = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
        raise RuntimeError(
            f"{max(processes, local_rank + 1)} processes on this node (LOCAL_RANK {local_rank}"
            f"{', LOCAL_WORLD_SIZE ' + per_node if per_node.isdigit() else ''}) but {gpus} visible GPU(s)"
            f"{shown}: ranks would share a GPU, which NCCL refuses. Start at most {gpus} process(es) per node "
            f"(shardwise run --nproc {gpus}, torchrun --nproc-per-node {gpus}) or make more GPUs visible "
            "(CUDA_VISIBLE_DEVICES)"
        )
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


_destroy_registered = False


def destroy_at_exit() -> None:
    """Destroy the default process group when the process exits, before the interpreter
    tears down the modules (registered once). Scripts written for DeepSpeed, Lightning or
    Accelerate never call `destroy_process_group`, and a gloo group left to interpreter
    teardown can abort the process (std::terminate, SIGABRT) after its work is done: its
    worker threads may still hold the last reference to a finished collective's tensors
    (distributed/retired_works.py). This holds whoever created the group: a Lightning,
    Accelerate or Hugging Face run on shardwise issues the front end's own collectives on
    it too. The collectives' last temporaries are left to the operating system for the same
    reason."""
    global _destroy_registered
    if not _destroy_registered:
        atexit.register(_destroy_if_initialized)
        _destroy_registered = True


def _destroy_if_initialized() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    keep_past_exit()


def init_distributed() -> DistributedContext:
    """Return the data-parallel context, creating the default process group if needed.

    Backend: NCCL when CUDA is available, else gloo (docs/getting-started.md#launching).
    A process started by `srun` or `mpirun` rather than torchrun joins through its
    launcher's variables (`launcher_variables`).
    """
    timeout = collective_timeout()
    if not (dist.is_available() and dist.is_initialized()):
        os.environ.update(torchrun_variables(os.environ))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if dist.is_available() and dist.is_initialized():
        device = _pick_device(local_rank)
        destroy_at_exit()
        return DistributedContext(
            dist.get_rank(), dist.get_world_size(), local_rank, device, dist.group.WORLD, timeout
        )
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return DistributedContext(0, 1, 0, _pick_device(0), None, timeout)
    device = _pick_device(local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend=backend,
        timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )
    destroy_at_exit()
    return DistributedContext(
        dist.get_rank(), dist.get_world_size(), local_rank, device, dist.group.WORLD, timeout
    )
