"""Column-parallel layers under Megatron sequence parallelism keep their input sharded.

Entering a tensor region with sequence parallelism all-gathers the sequence shards into
the whole sequence (regions.py). If the column-parallel linears that read it saved that
whole-sequence tensor for their weight gradient, every tensor rank would keep the full
b·s·h input of each region until backward, and activation memory would not fall by the
tensor size. As Megatron does (Korthikanti et al., 2022, §4.2.2), they save only this
rank's shard and all-gather it again in backward.

The gathered tensor carries a `SequenceGather` (attribute `_shardwise_sequence_gather`):
the shard and a holder shared by every linear reading that tensor (Llama's q, k and v,
gate and up). In backward the first of them re-gathers, the others reuse the result and
the last one drops it, so each region costs one extra all-gather, not one per linear.
The input gradient is returned for the whole-sequence tensor, so the sum over the
linears is reduce-scattered once by the gather's own backward, as before.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

ATTRIBUTE = "_shardwise_sequence_gather"


class SequenceGather:
    """One region entry's re-gather in backward, shared by the linears that read it.
    `gather` all-gathers a shard along the sequence (regions.py owns the collective)."""

    def __init__(self, shard: torch.Tensor, gather: Callable[[torch.Tensor], torch.Tensor]):
        self.shard, self.gather = shard.detach(), gather
        self.users = 0
        self._whole: torch.Tensor | None = None

    def whole(self, shard: torch.Tensor) -> torch.Tensor:
        if self._whole is None:
            self._whole = self.gather(shard)
        return self._whole

    def release(self) -> None:
        self.users -= 1
        if self.users == 0:
            self._whole = None


def mark_gathered(whole: torch.Tensor, shard: torch.Tensor,
                  gather: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Tell the linears reading `whole` that it is the gather of `shard`."""
    setattr(whole, ATTRIBUTE, SequenceGather(shard, gather))
    return whole


class _LinearOnGathered(torch.autograd.Function):
    @staticmethod
    def forward(ctx, whole: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                shard: torch.Tensor, gather: SequenceGather) -> torch.Tensor:
        gather.users += 1
        ctx.gather, ctx.has_bias = gather, bias is not None
        ctx.save_for_backward(shard, weight)
        return F.linear(whole, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shard, weight = ctx.saved_tensors
        whole = ctx.gather.whole(shard)
        grad_input = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        flat_grad = grad.reshape(-1, grad.shape[-1])
        grad_weight = flat_grad.t().matmul(whole.reshape(-1, whole.shape[-1])) if ctx.needs_input_grad[1] else None
        grad_bias = flat_grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        ctx.gather.release()
        return grad_input, grad_weight, grad_bias, None, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear`, saving only the sequence shard when `x` is a marked whole-sequence gather."""
    gather: SequenceGather | None = getattr(x, ATTRIBUTE, None)
    if gather is None or not torch.is_grad_enabled():
        return F.linear(x, weight, bias)
    return _LinearOnGathered.apply(x, weight, bias, gather.shard, gather)
