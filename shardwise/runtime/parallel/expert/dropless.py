"""The all-to-all that moves tokens to the ranks holding their experts and back when no
token is dropped (Mixtral's routing): every expert takes all the tokens routed to it, so
how many rows go to each member differs from rank to rank and step to step.

Each rank sorts its (token, choice) pairs by expert and counts them per expert. The
counts go first (an all-to-all of E integers: member p receives, from every member q,
q's counts for p's E/P experts), so every rank knows how many rows it sends to and
receives from each member; then the rows move by an all-to-all with those split sizes.
The outputs come back by the same exchange with the split sizes swapped, and the
gradient of each exchange is the exchange the other way (rows return to where they came
from), so autograd runs through both.
"""

from __future__ import annotations

import torch

from shardwise.runtime.distributed.collectives import Communicator


class _UnevenAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows: torch.Tensor, comm: Communicator, send: list[int], receive: list[int],
                what: str) -> torch.Tensor:
        ctx.comm, ctx.send, ctx.receive, ctx.what = comm, send, receive, what
        return _exchange(rows, comm, send, receive, what)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        returned = _exchange(grad, ctx.comm, ctx.receive, ctx.send, f"gradient of the {ctx.what}")
        return returned, None, None, None, None


def _exchange(rows: torch.Tensor, comm: Communicator, send: list[int], receive: list[int], what: str) -> torch.Tensor:
    rows = rows.contiguous()
    received = rows.new_empty((sum(receive), *rows.shape[1:]))
    comm.all_to_all_uneven(received, rows, output_splits=receive, input_splits=send, what=what).wait()
    return received


class DroplessRoute:
    """One layer call's routing across the expert group: which rows go where, and back.

    `expert_of_row`: the expert (0..E-1) of each row this rank routes, rows sorted by
    expert. After `dispatch`, `local_expert` says which of this rank's E/P experts each
    received row is for (received rows come grouped by sender, then by expert)."""

    def __init__(self, expert_of_row: torch.Tensor, num_experts: int, comm: Communicator):
        if num_experts % comm.size:
            raise ValueError(f"{num_experts} experts do not split over the {comm.size} ranks of the expert group; "
                             "use an expert-parallel size that divides the number of experts")
        self.comm = comm
        local = num_experts // comm.size
        counts = torch.bincount(expert_of_row, minlength=num_experts)
        received = torch.empty_like(counts)
        comm.all_to_all(received, counts, "routed token counts per expert").wait()
        per_member = received.view(comm.size, local)  # [q, e]: rows from member q for local expert e
        self.send = counts.view(comm.size, local).sum(1).tolist()
        self.receive = per_member.sum(1).tolist()
        self.local_expert = torch.arange(local, device=counts.device).repeat(comm.size).repeat_interleave(
            per_member.reshape(-1))

    def dispatch(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows (sorted by expert) to the members holding their experts."""
        return _UnevenAllToAll.apply(rows, self.comm, self.send, self.receive, "tokens for the experts")

    def combine(self, outputs: torch.Tensor) -> torch.Tensor:
        """The experts' outputs of the received rows back to the rows' ranks, in their order."""
        return _UnevenAllToAll.apply(outputs, self.comm, self.receive, self.send, "tokens from the experts")
