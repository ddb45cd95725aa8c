"""Join (or start) the process group the way `torchrun` users expect.

`initialize` must work in three situations without the user doing anything: launched by
`torchrun`/`shardwise run` (RANK, WORLD_SIZE, MASTER_ADDR... in the environment), inside a
program that already called `init_process_group` (tests, notebooks, other frameworks), and
as a plain single process (no environment at all: no process group, world size 1).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_SECONDS = 600.0
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
    seconds = float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_SECONDS))
    return datetime.timedelta(seconds=seconds)


def _pick_device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def init_distributed() -> DistributedContext:
    """Return the data-parallel context, creating the default process group if needed.

    Backend: NCCL when CUDA is available, else gloo (as SPEC §2 says).
    """
    timeout = collective_timeout()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if dist.is_available() and dist.is_initialized():
        device = _pick_device(local_rank)
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
    return DistributedContext(
        dist.get_rank(), dist.get_world_size(), local_rank, device, dist.group.WORLD, timeout
    )
