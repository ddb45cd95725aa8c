"""Ulysses' all-to-all: sequence shards <-> head shards, as an autograd function.

Before attention each of the S ranks of the sequence group holds all heads of s/S
positions; attention needs all positions of a head. One all-to-all turns
(batch, s/S, heads, dim) into (batch, s, heads/S, dim): rank r sends its positions of
head group j to rank j and receives head group r of every rank's positions. After
attention the inverse all-to-all brings the output back to sequence shards. Backward of
each is the other. Each moves (S-1)/S of a tensor of b*s*h/S elements per rank.
"""

from __future__ import annotations

import torch

from shardwise.runtime.distributed.collectives import Communicator


def _all_to_all(x: torch.Tensor, comm: Communicator, scatter_dim: int, gather_dim: int, what: str) -> torch.Tensor:
    """Split `x` along `scatter_dim` into S chunks (chunk j to rank j) and concatenate the
    chunks received along `gather_dim`, in rank order."""
    size = comm.size
    if x.shape[scatter_dim] % size:
        raise ValueError(f"{what}: dimension of size {x.shape[scatter_dim]} does not split over the "
                         f"{size} ranks of the {comm.handle.describe()}")
    pieces = x.unflatten(scatter_dim, (size, x.shape[scatter_dim] // size)).movedim(scatter_dim, 0).contiguous()
    received = torch.empty_like(pieces)
    comm.all_to_all(received.view(-1), pieces.view(-1), what).wait()
    # received[j] is rank j's piece: its part of gather_dim
    return received.movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        ctx.comm = comm
        return _all_to_all(x, comm, 2, 1, "attention inputs from sequence shards to head shards")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all(grad, ctx.comm, 1, 2, "gradient of attention inputs back to sequence shards"), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        ctx.comm = comm
        return _all_to_all(x, comm, 1, 2, "attention output from head shards to sequence shards")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all(grad, ctx.comm, 2, 1, "gradient of attention output back to head shards"), None


def sequence_to_heads(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """(batch, s/S, heads, dim) -> (batch, s, heads/S, dim)."""
    return _SeqToHeads.apply(x, comm) if comm.size > 1 else x


def heads_to_sequence(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """(batch, s, heads/S, dim) -> (batch, s/S, heads, dim)."""
    return _HeadsToSeq.apply(x, comm) if comm.size > 1 else x
