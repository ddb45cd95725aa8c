"""The collectives at the edges of a tensor-parallel region, as autograd functions.

A tensor-parallel region is the stretch of a layer where each rank holds a slice of the
hidden features (a column-parallel output, a row-parallel input). Entering and leaving it
needs one collective in forward and its conjugate in backward (Megatron's f and g):

    copy_to_region        forward identity           backward all-reduce
    reduce_from_region    forward all-reduce         backward identity
    gather_from_region    forward all-gather (last)  backward keep own slice
    scatter_to_region     forward keep own slice     backward all-gather (last)

With Megatron sequence parallelism the parts of a layer outside the region (norms,
dropout, residual adds) hold 1/N of the sequence, and the all-reduces become an
all-gather and a reduce-scatter along the sequence dimension:

    gather_sequence          forward all-gather (seq)    backward reduce-scatter
    reduce_scatter_sequence  forward reduce-scatter      backward all-gather
    split_sequence           forward keep own chunk      backward all-gather
    join_sequence            forward all-gather (seq)    backward keep own chunk
                             (into computation replicated on every rank, e.g. the final norm)

Every collective goes through the group's `Communicator`, so its bytes are counted under
the group's purpose ("tensor" or "sequence") in `engine.comm_volume(per_group=True)`.
Activations are laid out (batch, sequence, ...): the sequence dimension is 1.
"""

from __future__ import annotations

import torch

from shardwise.runtime.distributed.collectives import Communicator
from shardwise.runtime.ops.region_collectives import apply_region, register_region_functions
from shardwise.runtime.parallel.tensor.sequence_gather import mark_gathered

SEQUENCE_DIM = 1


def _all_reduce(tensor: torch.Tensor, comm: Communicator, what: str) -> torch.Tensor:
    out = tensor.clone(memory_format=torch.contiguous_format)
    comm.all_reduce(out, what).wait()
    return out


def _all_gather(tensor: torch.Tensor, comm: Communicator, dim: int, what: str) -> torch.Tensor:
    """Concatenate every rank's `tensor` along `dim` (rank order)."""
    moved = tensor.movedim(dim, 0).contiguous()
    full = moved.new_empty((comm.size * moved.shape[0], *moved.shape[1:]))
    comm.all_gather(full.view(-1), moved.view(-1), what).wait()
    return full.movedim(0, dim)


def _reduce_scatter(tensor: torch.Tensor, comm: Communicator, dim: int, what: str) -> torch.Tensor:
    """Sum over ranks, keeping this rank's chunk along `dim`."""
    moved = tensor.movedim(dim, 0).contiguous()
    if moved.shape[0] % comm.size:
        raise ValueError(f"{what}: dimension {dim} of size {moved.shape[0]} does not split over {comm.size} ranks")
    out = moved.new_empty((moved.shape[0] // comm.size, *moved.shape[1:]))
    comm.reduce_scatter(out.view(-1), moved.view(-1), what).wait()
    return out.movedim(0, dim)


def _own_chunk(tensor: torch.Tensor, comm: Communicator, dim: int, what: str) -> torch.Tensor:
    if tensor.shape[dim] % comm.size:
        raise ValueError(f"{what}: dimension {dim} of size {tensor.shape[dim]} does not split over "
                         f"{comm.size} ranks of the {comm.handle.describe()}")
    return tensor.chunk(comm.size, dim)[comm.rank].contiguous()


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_reduce(grad, ctx.comm, "gradient entering a tensor-parallel region"), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        return _all_reduce(x, comm, "partial sums leaving a tensor-parallel region")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        ctx.comm = comm
        return _all_gather(x, comm, -1, "feature slices leaving a tensor-parallel region")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _own_chunk(grad, ctx.comm, -1, "gradient of gathered features"), None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        ctx.comm = comm
        return _own_chunk(x, comm, -1, "features entering a tensor-parallel region")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_gather(grad, ctx.comm, -1, "gradient of scattered features"), None


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        ctx.comm = comm
        return _all_gather(x, comm, SEQUENCE_DIM, "sequence shards entering a tensor-parallel region")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _reduce_scatter(grad, ctx.comm, SEQUENCE_DIM, "gradient leaving to sequence shards"), None


class _ReduceScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        ctx.comm = comm
        return _reduce_scatter(x, comm, SEQUENCE_DIM, "partial sums leaving to sequence shards")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_gather(grad, ctx.comm, SEQUENCE_DIM, "gradient of sequence shards"), None


class _SplitSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        ctx.comm = comm
        return _own_chunk(x, comm, SEQUENCE_DIM, "the sequence entering the sequence-parallel layers")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_gather(grad, ctx.comm, SEQUENCE_DIM, "gradient of the sequence chunks"), None


class _JoinSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        ctx.comm = comm
        return _all_gather(x, comm, SEQUENCE_DIM, "sequence shards after the sequence-parallel layers")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _own_chunk(grad, ctx.comm, SEQUENCE_DIM, "gradient of the joined sequence"), None


register_region_functions(_CopyToRegion, _ReduceFromRegion, _GatherFromRegion, _ScatterToRegion, _GatherSequence,
                          _ReduceScatterSequence, _SplitSequence, _JoinSequence)  # traceable when compiled


def copy_to_region(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    return apply_region("_CopyToRegion", x, comm) if comm.size > 1 else x


def reduce_from_region(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    return apply_region("_ReduceFromRegion", x, comm) if comm.size > 1 else x


def gather_from_region(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    return apply_region("_GatherFromRegion", x, comm) if comm.size > 1 else x


def scatter_to_region(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    return apply_region("_ScatterToRegion", x, comm) if comm.size > 1 else x


def gather_sequence(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    return apply_region("_GatherSequence", x, comm) if comm.size > 1 else x


def reduce_scatter_sequence(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    return apply_region("_ReduceScatterSequence", x, comm) if comm.size > 1 else x


def split_sequence(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    return apply_region("_SplitSequence", x, comm) if comm.size > 1 else x


def join_sequence(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    return apply_region("_JoinSequence", x, comm) if comm.size > 1 else x


def enter_region(x: torch.Tensor, comm: Communicator, sequence_parallel: bool) -> torch.Tensor:
    """Input of column-parallel layers: replicated (copy) or sequence-sharded (gather; the
    whole sequence is marked so the linears reading it save only `x`, sequence_gather.py)."""
    if not sequence_parallel or comm.size == 1:
        return copy_to_region(x, comm)
    return mark_gathered(gather_sequence(x, comm), x, lambda shard: _all_gather(
        shard, comm, SEQUENCE_DIM, "sequence shards re-gathered for a column-parallel weight gradient"))


def leave_region(x: torch.Tensor, comm: Communicator, sequence_parallel: bool) -> torch.Tensor:
    """Output of row-parallel layers: summed (all-reduce) or summed and sequence-sharded."""
    return reduce_scatter_sequence(x, comm) if sequence_parallel else reduce_from_region(x, comm)
