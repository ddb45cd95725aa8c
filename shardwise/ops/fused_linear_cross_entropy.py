"""Linear layer + cross-entropy without the full logits.

A language model's loss is `cross_entropy(h·Wᵀ, targets)` over N = batch·sequence rows
and a vocabulary of V words: the logits alone are N·V floats (4096 tokens at V = 32k:
512 MB in fp32), and autograd keeps them, or their softmax, until backward. Here the rows
are cut into chunks; for each chunk the logits are computed, turned into the loss and,
when a backward will follow, straight into the gradients of h and W (softmax minus the
one-hot target, times W or h), and then dropped. At most one chunk's logits exist at a
time, so the loss's memory falls from N·V floats to chunk·V; by default a chunk's logits
are about as large as h itself.

The gradients are therefore computed during the forward (as Liger-Kernel's fused loss
does) and the backward only scales them by the incoming gradient, which is why the
result can be differentiated once, as a training loss is. In `torch.no_grad()` only the
loss is computed.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100


def default_chunk_rows(rows: int, hidden: int, vocab: int) -> int:
    """Rows per chunk such that a chunk's logits (rows·V) are about the size of h (N·H)."""
    return max(1, min(rows, math.ceil(rows * hidden / vocab)))


def _chunk_loss_and_grads(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                          ignore_index: int, scale: float, need_grads: bool):
    """Summed loss of one chunk and, if asked, d(scale·loss)/d(logits) folded into h, W, b."""
    logits = F.linear(h, weight, bias).float()
    loss = F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="sum")
    if not need_grads:
        return loss, None
    grad_logits = torch.softmax(logits, dim=-1)
    valid = targets != ignore_index
    rows = torch.arange(len(targets), device=targets.device)[valid]
    grad_logits[rows, targets[valid]] -= 1
    grad_logits[~valid] = 0
    grad_logits = (grad_logits * scale).to(h.dtype)
    return loss, (grad_logits @ weight, grad_logits.t() @ h, grad_logits.sum(0) if bias is not None else None)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                ignore_index: int, reduction: str, chunk_rows: int) -> torch.Tensor:
        need_grads = any(ctx.needs_input_grad[:3])
        count = int((targets != ignore_index).sum()) if reduction == "mean" else 1
        scale = 1.0 / max(count, 1) if reduction == "mean" else 1.0
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        grad_h = torch.empty_like(h) if need_grads else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_grads else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=h.device) if need_grads and bias is not None \
            else None
        for start in range(0, h.shape[0], chunk_rows):
            part = slice(start, start + chunk_rows)
            loss, grads = _chunk_loss_and_grads(h[part], weight, bias, targets[part], ignore_index, scale, need_grads)
            total += loss
            if grads is not None:
                grad_h[part] = grads[0]
                grad_w += grads[1]
                if grad_b is not None:
                    grad_b += grads[2]
        if need_grads:
            ctx.save_for_backward(grad_h, grad_w.to(weight.dtype), None if grad_b is None else grad_b.to(bias.dtype))
        # A mean over no target at all is 0/0, as F.cross_entropy returns it.
        return total / count if reduction == "mean" else total

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_h, grad_w, grad_b = ctx.saved_tensors
        grads = [g * grad_loss.to(g.dtype) if g is not None else None for g in (grad_h, grad_w, grad_b)]
        return grads[0], grads[1], grads[2], None, None, None, None


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                               bias: torch.Tensor | None = None, ignore_index: int = IGNORE_INDEX,
                               reduction: str = "mean", chunk_rows: int | None = None) -> torch.Tensor:
    """`F.cross_entropy(F.linear(hidden, weight, bias).float(), targets)` over all leading
    dimensions of `hidden` (…, H) and `targets` (…), computed chunk by chunk."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction {reduction!r} is not supported: use 'mean' or 'sum'")
    h = hidden.reshape(-1, hidden.shape[-1])
    flat_targets = targets.reshape(-1)
    if flat_targets.shape[0] != h.shape[0]:
        raise ValueError(f"{h.shape[0]} rows of hidden states but {flat_targets.shape[0]} targets")
    rows = chunk_rows or default_chunk_rows(h.shape[0], h.shape[1], weight.shape[0])
    return _FusedLinearCrossEntropy.apply(h, weight, bias, flat_targets, ignore_index, reduction, rows)


class FusedLMHead(nn.Linear):
    """An output layer that, given targets, returns the mean cross-entropy through
    `fused_linear_cross_entropy` instead of logits. It is an `nn.Linear` holding the
    original layer's Parameter objects, so tied embeddings stay tied, checkpoints keep
    their names and ZeRO-3 gathers the weight for this module's forward as before."""

    computes_loss = True  # shardwise's GPT passes its targets to an output layer that says so

    @classmethod
    def from_linear(cls, linear: nn.Linear, chunk_rows: int | None = None) -> "FusedLMHead":
        head = cls.__new__(cls)
        nn.Module.__init__(head)
        head.in_features, head.out_features = linear.in_features, linear.out_features
        head.weight, head.bias = linear.weight, linear.bias
        head.chunk_rows = chunk_rows
        return head

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if targets is None:
            return super().forward(hidden)
        return fused_linear_cross_entropy(hidden, self.weight, targets, self.bias, chunk_rows=self.chunk_rows)
