"""`deepspeed.comm`: DeepSpeed's collective functions, as thin calls to torch.distributed.

DeepSpeed routes these through its own backend object to time and log them; here they
are torch's functions with DeepSpeed's names and defaults (`group=None` is the whole
world), timed by DeepSpeed's communication logger when it is on (`configure`,
`log_summary`: comms_logging.py). `init_distributed` joins the job the launcher
describes (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK). With `auto_mpi_discovery`, where DeepSpeed asks
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

from shardwise.frontends.deepspeed.api.comms_logging import (configure, get_comm_operation_count,
                                                              get_logged_comm_ops, has_comm_data, log_summary,
                                                              logged, reset_log)
from shardwise.runtime.distributed.launcher_variables import torchrun_variables
from shardwise.runtime.distributed.setup import collective_timeout, destroy_at_exit
from shardwise.runtime.base.torch_compat import all_gather_single, reduce_scatter_single

log = logging.getLogger("shardwise")

DEFAULT_PORT = 29500  # DeepSpeed's TORCH_DISTRIBUTED_DEFAULT_PORT
TORCH_DISTRIBUTED_DEFAULT_PORT = DEFAULT_PORT
default_pg_timeout = datetime.timedelta(minutes=30)  # torch's, under DeepSpeed's name
P2POp = dist.P2POp
ProcessGroup = dist.ProcessGroup
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")

__all__ = [
    "P2POp", "ProcessGroup", "ReduceOp", "TORCH_DISTRIBUTED_DEFAULT_PORT", "all_gather", "all_gather_coalesced",
    "all_gather_into_tensor", "all_gather_object", "all_reduce", "all_reduce_coalesced", "all_to_all",
    "all_to_all_single", "barrier", "batch_isend_irecv", "broadcast", "broadcast_object_list", "configure",
    "default_pg_timeout", "destroy_process_group", "gather", "get_all_ranks_from_group", "get_comm_operation_count",
    "get_global_rank", "get_local_rank", "get_local_rank_from_launcher", "get_logged_comm_ops", "get_rank",
    "get_world_group", "get_world_rank_from_launcher", "get_world_size", "get_world_size_from_launcher",
    "has_all_gather_into_tensor", "has_all_reduce_coalesced", "has_coalescing_manager", "has_comm_data",
    "has_reduce_scatter_tensor", "inference_all_reduce", "init_distributed", "irecv", "is_available",
    "is_initialized", "isend", "log_summary", "monitored_barrier", "new_group", "recv", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "reset_log", "scatter", "send",
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


@logged
def barrier(group: Any = None, async_op: bool = False, device_ids: list[int] | None = None) -> Any:
    return dist.barrier(group=group, async_op=async_op, device_ids=device_ids)


@logged
def all_reduce(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, group: Any = None, async_op: bool = False) -> Any:
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


@logged
def reduce(tensor: torch.Tensor, dst: int, op: ReduceOp = ReduceOp.SUM, group: Any = None,
           async_op: bool = False) -> Any:
    return dist.reduce(tensor, dst, op=op, group=group, async_op=async_op)


@logged
def broadcast(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False) -> Any:
    return dist.broadcast(tensor, src, group=group, async_op=async_op)


@logged
def broadcast_object_list(object_list: list[Any], src: int, group: Any = None, device: Any = None) -> None:
    dist.broadcast_object_list(object_list, src, group=group, device=device)


@logged
def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None, async_op: bool = False) -> Any:
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_gather_object(object_list: list[Any], obj: Any, group: Any = None) -> None:
    dist.all_gather_object(object_list, obj, group=group)


@logged
def all_gather_into_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, group: Any = None,
                           async_op: bool = False) -> Any:
    return all_gather_single(output_tensor, tensor, group=group, async_op=async_op)


@logged
def reduce_scatter_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM,
                          group: Any = None, async_op: bool = False) -> Any:
    return reduce_scatter_single(output_tensor, tensor, op=op, group=group, async_op=async_op)


@logged
def all_to_all_single(output: torch.Tensor, tensor: torch.Tensor, output_split_sizes: list[int] | None = None,
                      input_split_sizes: list[int] | None = None, group: Any = None, async_op: bool = False) -> Any:
    return dist.all_to_all_single(output, tensor, output_split_sizes, input_split_sizes, group=group,
                                  async_op=async_op)


@logged
def gather(tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None, dst: int = 0, group: Any = None,
           async_op: bool = False) -> Any:
    return dist.gather(tensor, gather_list, dst, group=group, async_op=async_op)


@logged
def scatter(tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None = None, src: int = 0, group: Any = None,
            async_op: bool = False) -> Any:
    return dist.scatter(tensor, scatter_list, src, group=group, async_op=async_op)


@logged
def send(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> None:
    dist.send(tensor, dst, group=group, tag=tag)


@logged
def recv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0) -> int:
    return dist.recv(tensor, src, group=group, tag=tag)


@logged
def isend(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> Any:
    return dist.isend(tensor, dst, group=group, tag=tag)


@logged
def irecv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0) -> Any:
    return dist.irecv(tensor, src, group=group, tag=tag)


@logged
def all_to_all(output_tensor_list: list[torch.Tensor], input_tensor_list: list[torch.Tensor], group: Any = None,
               async_op: bool = False) -> Any:
    return dist.all_to_all(output_tensor_list, input_tensor_list, group=group, async_op=async_op)


@logged
def reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor], op: ReduceOp = ReduceOp.SUM,
                   group: Any = None, async_op: bool = False) -> Any:
    return dist.reduce_scatter(output, input_list, op=op, group=group, async_op=async_op)


@logged
def all_gather_coalesced(output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor], group: Any = None,
                         async_op: bool = False) -> Any:
    """Each input gathered into its output (world x its size), one collective per pair, as
    DeepSpeed's torch backend issues them; the last one's work with `async_op`."""
    work = None
    for output, tensor in zip(output_tensors, input_tensors):
        work = all_gather_single(output, tensor, group=group, async_op=async_op)
    return work


@logged
def all_reduce_coalesced(tensors: list[torch.Tensor], op: ReduceOp = ReduceOp.SUM, group: Any = None,
                         async_op: bool = False) -> Any:
    """The tensors summed as one flat buffer (one collective), then copied back in place;
    done before it returns, whatever `async_op` says (nothing is left to wait for)."""
    if not tensors:
        return None
    flat = torch.cat([tensor.reshape(-1) for tensor in tensors])
    dist.all_reduce(flat, op=op, group=group)
    offset = 0
    for tensor in tensors:
        tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
        offset += tensor.numel()
    return None


@logged
def inference_all_reduce(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, group: Any = None,
                         async_op: bool = False) -> Any:
    """DeepSpeed's all-reduce for inference kernels: here the same all-reduce."""
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


@logged
def batch_isend_irecv(p2p_op_list: list[dist.P2POp]) -> list[Any]:
    return dist.batch_isend_irecv(p2p_op_list)


def monitored_barrier(group: Any = None, timeout: datetime.timedelta | None = None, wait_all_ranks: bool = False,
                      **logging: Any) -> Any:
    """torch's barrier that names the ranks that did not arrive (gloo groups)."""
    return dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)


def get_all_ranks_from_group(group: Any = None) -> list[int]:
    """The global ranks of `group` (None: the world), in group order."""
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


def has_all_gather_into_tensor() -> bool:
    return True


def has_reduce_scatter_tensor() -> bool:
    return True


def has_all_reduce_coalesced() -> bool:
    return True


def has_coalescing_manager() -> bool:
    return True


def get_world_rank_from_launcher() -> int:
    return int(os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", 0)))


def get_world_size_from_launcher() -> int:
    return int(os.environ.get("WORLD_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", 1)))


def get_local_rank_from_launcher() -> int:
    return int(os.environ.get("LOCAL_RANK", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", 0)))
