"""Linear layer + cross-entropy without the full logits.

A language model's loss is `cross_entropy(h·Wᵀ, targets)` over N = batch·sequence rows
and a vocabulary of V words: the logits alone are N·V floats (4096 tokens at V = 32k:
512 MB in fp32), and autograd keeps them, or their softmax, until backward. Here the rows
are cut into chunks; for each chunk the logits are computed, turned into the loss and,
when a backward will follow, straight into the gradients of h and W (softmax minus the
one-hot target, times W or h), and then dropped. At most one chunk's logits exist at a
time, so the loss's memory falls from N·V floats to chunk·V; by default a chunk has as
many rows as the hidden width (default_chunk_rows).

The gradients are therefore computed during the forward (as Liger-Kernel's fused loss
does: the logits are computed once, not again in backward; the softmax is made in place
of the log-softmax and the weight gradient summed by addmm into one buffer) and the
backward only scales them by the incoming gradient, which is why the
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
    """Rows per chunk: as many as the hidden width, or more if h (N·H) is larger than W.

    The loss holds W's gradient (V·H floats) anyway, so a chunk of H rows (logits of V·H
    floats) at most doubles that, while the weight gradient's accumulation, which reads
    and writes all V·H entries once per chunk, costs no more memory traffic than the
    chunk's own matrix products. Smaller chunks (Liger-Kernel's size, logits as large as
    h) made that accumulation dominate on CPU: 2.1x slower than the unfused loss."""
    return max(1, min(rows, max(hidden, math.ceil(rows * hidden / vocab))))


def _chunk_loss(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed loss of the chunk, its log-softmax), for rows whose target is not ignored."""
    logits = F.linear(h, weight, bias).float()
    log_probs = torch.log_softmax(logits, dim=-1)
    del logits
    picked = log_probs.gather(1, targets.where(valid, 0).unsqueeze(1)).squeeze(1)
    return -(picked * valid).sum(), log_probs


def _grad_logits_(log_probs: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor, all_valid: bool) -> torch.Tensor:
    """d(summed loss)/d(logits) = softmax − one-hot(target), in place of the log-softmax;
    zero on ignored rows."""
    grad = log_probs.exp_()
    if not all_valid:
        grad.mul_(valid.unsqueeze(1))
    rows = torch.arange(len(targets), device=targets.device)
    grad[rows, targets.where(valid, 0)] -= valid.to(grad.dtype)
    return grad


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                ignore_index: int, reduction: str, chunk_rows: int) -> torch.Tensor:
        need_grads = any(ctx.needs_input_grad[:3])
        valid = targets != ignore_index
        count = int(valid.sum())
        all_valid = count == len(targets)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        grad_h = torch.empty_like(h) if need_grads else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_grads else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=h.device) if need_grads and bias is not None \
            else None
        for start in range(0, h.shape[0], chunk_rows):
            part = slice(start, start + chunk_rows)
            loss, log_probs = _chunk_loss(h[part], weight, bias, targets[part], valid[part])
            total += loss
            if not need_grads:
                continue
            grad = _grad_logits_(log_probs, targets[part], valid[part], all_valid).to(h.dtype)
            torch.mm(grad, weight, out=grad_h[part])
            if grad.dtype == grad_w.dtype:
                grad_w.addmm_(grad.t(), h[part])
            else:  # 16-bit products summed in fp32 (addmm_ takes one dtype)
                grad_w += grad.t() @ h[part]
            if grad_b is not None:
                grad_b += grad.sum(0)
        # The mean's 1/count is applied once, in backward, to the summed gradients.
        ctx.scale = 1.0 / max(count, 1) if reduction == "mean" else 1.0
        if need_grads:
            ctx.save_for_backward(grad_h, grad_w.to(weight.dtype), None if grad_b is None else grad_b.to(bias.dtype))
        # A mean over no target at all is 0/0, as F.cross_entropy returns it.
        return total / count if reduction == "mean" else total

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_h, grad_w, grad_b = ctx.saved_tensors
        grads = [g * (grad_loss * ctx.scale).to(g.dtype) if g is not None else None for g in (grad_h, grad_w, grad_b)]
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
