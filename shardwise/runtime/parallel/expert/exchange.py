"""The all-to-all that moves tokens to the ranks holding their experts and back.

A layer with E experts over an expert group of P ranks routes its tokens into a buffer
(E, C, d): C slots per expert. Experts e = p·E/P .. (p+1)·E/P - 1 live on member p, so
chunk p of dim 0 goes to member p, and member p receives, from every member q, q's
tokens for its own experts. The same exchange brings the outputs back. Its gradient is
the same exchange again: an all-to-all is a permutation of chunks, and the transpose of
that permutation is the all-to-all from the receiving side, so backward sends each
chunk's gradient back to where the chunk came from.
"""

from __future__ import annotations

import torch

from shardwise.runtime.distributed.collectives import Communicator


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens: torch.Tensor, comm: Communicator, what: str) -> torch.Tensor:
        ctx.comm, ctx.what = comm, what
        return _exchange(tokens, comm, what)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.comm, f"gradient of the {ctx.what}"), None, None


def _exchange(tokens: torch.Tensor, comm: Communicator, what: str) -> torch.Tensor:
    tokens = tokens.contiguous()
    received = torch.empty_like(tokens)
    comm.all_to_all(received, tokens, what).wait()
    return received


def exchange_with_experts(tokens: torch.Tensor, comm: Communicator, what: str = "tokens for the experts") -> torch.Tensor:
    """All-to-all of `tokens` (dim 0 a multiple of the group size: chunk p to member p)
    over the expert group, differentiable; the identity on a group of one."""
    if tokens.shape[0] % comm.size:
        raise ValueError(f"the all-to-all of {what} splits dim 0 ({tokens.shape[0]}) over {comm.size} ranks of "
                         "the expert group; the number of experts must be a multiple of the expert-parallel size")
    if comm.size == 1:
        return tokens
    return _AllToAll.apply(tokens, comm, what)
