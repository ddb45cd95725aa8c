"""`deepspeed.comm`: DeepSpeed's collective functions, as thin calls to torch.distributed.

DeepSpeed routes these through its own backend object to time and log them; here they
are torch's functions with DeepSpeed's names and defaults (`group=None` is the whole
world). `init_distributed` joins the job the launcher describes (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, LOCAL_RANK). With `auto_mpi_discovery`, where DeepSpeed asks
mpi4py, the ranks of a job started by `mpirun` or `srun` are read from the launcher's
variables (`launcher_variables`), the port being `distributed_port`. With no launcher at
all it starts a one-process group on `distributed_port`, as DeepSpeed's MPI discovery
does for a process started alone.
"""

from __future__ import annotations

import datetime
import logging
import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from shardwise.runtime.distributed.launcher_variables import torchrun_variables
from shardwise.runtime.distributed.setup import collective_timeout, destroy_at_exit
from shardwise.runtime.base.torch_compat import all_gather_single, reduce_scatter_single

log = logging.getLogger("shardwise")

DEFAULT_PORT = 29500  # DeepSpeed's TORCH_DISTRIBUTED_DEFAULT_PORT
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")

__all__ = [
    "ReduceOp", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce", "all_to_all_single",
    "barrier", "broadcast", "broadcast_object_list", "destroy_process_group", "gather", "get_global_rank",
    "get_local_rank", "get_rank", "get_world_group", "get_world_size", "init_distributed", "irecv", "isend",
    "is_available", "is_initialized", "new_group", "recv", "reduce", "reduce_scatter_tensor", "scatter", "send",
]


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = DEFAULT_PORT, verbose: bool = True,
                     timeout: datetime.timedelta | None = None, init_method: str | None = None,
                     dist_init_required: bool | None = None, config: Any = None,
                     rank: int = -1, world_size: int = -1) -> None:
    """Create the default process group unless one exists. `dist_backend` None: NCCL
    with CUDA, else gloo; "nccl" on a machine without CUDA: gloo, with a warning.
    `dist_init_required=False` only checks that a group exists."""
    if dist.is_initialized():
        return
    if dist_init_required is False:
        raise RuntimeError("dist_init_required=False but torch.distributed is not initialized: call "
                           "torch.distributed.init_process_group first, or leave dist_init_required unset")
    if auto_mpi_discovery and init_method is None:
        os.environ.update(torchrun_variables(os.environ, default_port=distributed_port))
    if init_method is None and not all(name in os.environ for name in LAUNCHER_VARIABLES[:2]):
        # Not started by a launcher: a job of this one process.
        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(distributed_port))
    os.environ.setdefault("LOCAL_RANK", "0")
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl" and not torch.cuda.is_available():
        # A script written for GPUs, run on a CPU machine: NCCL cannot start without CUDA.
        log.warning("init_distributed(dist_backend='nccl'): NCCL needs CUDA, which this machine lacks; using gloo")
        backend = "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    kwargs: dict[str, Any] = {"rank": rank, "world_size": world_size} if init_method is not None else {}
    dist.init_process_group(backend=backend, init_method=init_method, timeout=timeout or collective_timeout(),
                            **kwargs)
    destroy_at_exit()


def is_initialized() -> bool:
    return dist.is_initialized()


def is_available() -> bool:
    return dist.is_available()


def get_rank(group: Any = None) -> int:
    return dist.get_rank(group)


def get_world_size(group: Any = None) -> int:
    return dist.get_world_size(group)


def get_local_rank() -> int:
    """This process's rank on its node, from LOCAL_RANK as the launcher set it."""
    return int(os.environ.get("LOCAL_RANK", 0))


def get_global_rank(group: Any = None, group_rank: int = 0) -> int:
    return dist.get_global_rank(group if group is not None else dist.group.WORLD, group_rank)


def get_world_group() -> Any:
    return dist.group.WORLD


def new_group(ranks: list[int]) -> Any:
    return dist.new_group(ranks, timeout=collective_timeout())  # shardwise's timeout, not gloo's 30 minutes


def destroy_process_group(group: Any = None) -> None:
    dist.destroy_process_group(group)


def barrier(group: Any = None, async_op: bool = False, device_ids: list[int] | None = None) -> Any:
    return dist.barrier(group=group, async_op=async_op, device_ids=device_ids)


def all_reduce(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, group: Any = None, async_op: bool = False) -> Any:
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def reduce(tensor: torch.Tensor, dst: int, op: ReduceOp = ReduceOp.SUM, group: Any = None,
           async_op: bool = False) -> Any:
    return dist.reduce(tensor, dst, op=op, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False) -> Any:
    return dist.broadcast(tensor, src, group=group, async_op=async_op)


def broadcast_object_list(object_list: list[Any], src: int, group: Any = None, device: Any = None) -> None:
    dist.broadcast_object_list(object_list, src, group=group, device=device)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None, async_op: bool = False) -> Any:
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_gather_object(object_list: list[Any], obj: Any, group: Any = None) -> None:
    dist.all_gather_object(object_list, obj, group=group)


def all_gather_into_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, group: Any = None,
                           async_op: bool = False) -> Any:
    return all_gather_single(output_tensor, tensor, group=group, async_op=async_op)


def reduce_scatter_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM,
                          group: Any = None, async_op: bool = False) -> Any:
    return reduce_scatter_single(output_tensor, tensor, op=op, group=group, async_op=async_op)


def all_to_all_single(output: torch.Tensor, tensor: torch.Tensor, output_split_sizes: list[int] | None = None,
                      input_split_sizes: list[int] | None = None, group: Any = None, async_op: bool = False) -> Any:
    return dist.all_to_all_single(output, tensor, output_split_sizes, input_split_sizes, group=group,
                                  async_op=async_op)


def gather(tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None, dst: int = 0, group: Any = None,
           async_op: bool = False) -> Any:
    return dist.gather(tensor, gather_list, dst, group=group, async_op=async_op)


def scatter(tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None = None, src: int = 0, group: Any = None,
            async_op: bool = False) -> Any:
    return dist.scatter(tensor, scatter_list, src, group=group, async_op=async_op)


def send(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> None:
    dist.send(tensor, dst, group=group, tag=tag)


def recv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0) -> int:
    return dist.recv(tensor, src, group=group, tag=tag)


def isend(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> Any:
    return dist.isend(tensor, dst, group=group, tag=tag)


def irecv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0) -> Any:
    return dist.irecv(tensor, src, group=group, tag=tag)
