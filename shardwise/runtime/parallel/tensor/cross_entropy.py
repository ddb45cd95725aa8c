"""Cross-entropy over logits split by vocabulary, without gathering them.

Rank r holds logits z[:, V_r] for its vocabulary rows. Per token, the loss is
logsumexp(z) - z[target]. Each rank computes its local logsumexp and, where the target
falls in its rows, the target's logit (0 elsewhere); one all-gather of these two numbers
per token gives every rank the global logsumexp (a logsumexp of the local ones, stable
without a separate max) and the target logit (a sum). Backward needs no communication:
d loss / d z[:, V_r] = softmax(z)[:, V_r] - onehot(target)[:, V_r], with softmax from the
local logits and the global logsumexp. Per token this moves 2 floats per rank instead of
the V / N logits a gather would.

`VocabShardedLogits` marks the output of the vocabulary-parallel head: a tensor subclass
that survives the reshapes and casts a loss function applies (`view`, `reshape`, `float`,
`to`, `contiguous`, slicing) and routes `F.cross_entropy` to this function, so a model's
own `F.cross_entropy(logits.view(-1, logits.size(-1)), targets)` stays correct unchanged.
Softmax, argmax, top-k, sampling and the like across the vocabulary are refused (on a
slice they would silently be wrong); any other operation returns a plain tensor of this
rank's vocabulary slice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten

from shardwise.runtime.distributed.collectives import Communicator


@dataclass(frozen=True)
class VocabShard:
    comm: Communicator
    start: int  # first vocabulary row this rank holds
    vocab_size: int  # the full vocabulary


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, shard: VocabShard, ignore_index: int):
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        local_vocab = logits.shape[-1]
        local = target - shard.start
        inside = (local >= 0) & (local < local_vocab) & (target != ignore_index)
        local = local.masked_fill(~inside, 0)
        statistics = torch.stack((
            torch.logsumexp(logits, dim=-1),
            logits.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~inside, 0.0),
        ))
        if shard.comm.size > 1:
            gathered = statistics.new_empty((shard.comm.size, *statistics.shape))
            shard.comm.all_gather(gathered.view(-1), statistics.contiguous().view(-1),
                                  "logsumexp and target logits of the vocabulary-parallel loss").wait()
            lse = torch.logsumexp(gathered[:, 0], dim=0)
            target_logit = gathered[:, 1].sum(dim=0)
        else:
            lse, target_logit = statistics[0], statistics[1]
        valid = target != ignore_index
        ctx.save_for_backward(logits, lse, local, inside, valid)
        return (lse - target_logit).masked_fill(~valid, 0.0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, lse, local, inside, valid = ctx.saved_tensors
        grad_logits = torch.exp(logits - lse.unsqueeze(-1))
        grad_logits.scatter_add_(-1, local.unsqueeze(-1), -inside.to(grad_logits.dtype).unsqueeze(-1))
        grad_logits.mul_((grad * valid).unsqueeze(-1))
        return grad_logits, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, shard: VocabShard, ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """F.cross_entropy over the full vocabulary from this rank's logits [..., V/N]."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction {reduction!r}: use 'mean', 'sum' or 'none'")
    plain = logits.as_subclass(torch.Tensor) if isinstance(logits, VocabShardedLogits) else logits
    per_token = _VocabParallelCrossEntropy.apply(plain.reshape(-1, plain.shape[-1]), target.reshape(-1),
                                                 shard, ignore_index)
    if reduction == "none":
        return per_token.view(target.shape)
    total = per_token.sum()
    return total / (target != ignore_index).sum() if reduction == "mean" else total


_KEEPS_VOCAB = {
    torch.Tensor.view, torch.Tensor.reshape, torch.Tensor.float, torch.Tensor.to, torch.Tensor.contiguous,
    torch.Tensor.__getitem__, torch.Tensor.flatten, torch.Tensor.type_as, torch.Tensor.bfloat16,
    torch.Tensor.half, torch.Tensor.double,
}
# Functions that compare or normalise across the vocabulary: on one rank's slice they would
# silently give a wrong answer (sampling from the wrong distribution, an argmax over part
# of the vocabulary), so they are refused.
_ACROSS_VOCAB = {
    F.softmax, F.log_softmax, torch.softmax, torch.log_softmax, torch.Tensor.softmax, torch.Tensor.log_softmax,
    torch.argmax, torch.Tensor.argmax, torch.argmin, torch.Tensor.argmin, torch.max, torch.Tensor.max,
    torch.min, torch.Tensor.min, torch.topk, torch.Tensor.topk, torch.sort, torch.Tensor.sort,
    torch.logsumexp, torch.Tensor.logsumexp, torch.multinomial,
}


class VocabShardedLogits(torch.Tensor):
    """Logits holding this rank's vocabulary rows (see the module docstring)."""

    _vocab_shard: VocabShard

    @staticmethod
    def wrap(tensor: torch.Tensor, shard: VocabShard) -> "VocabShardedLogits":
        wrapped = tensor.as_subclass(VocabShardedLogits)
        wrapped._vocab_shard = shard
        return wrapped

    @property
    def vocab_shard(self) -> VocabShard:
        return self._vocab_shard

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        shard = next(a._vocab_shard for a in tree_flatten((args, kwargs))[0] if isinstance(a, VocabShardedLogits))
        if func is F.cross_entropy:
            return _cross_entropy(shard, *args, **kwargs)
        if func in _ACROSS_VOCAB:
            raise RuntimeError(
                f"{getattr(func, '__name__', func)} over tensor-parallel logits: this rank holds vocabulary rows "
                f"{shard.start}-{shard.start + args[0].shape[-1]} of {shard.vocab_size} only. Use F.cross_entropy "
                "(vocabulary-parallel), or gather the logits first (shardwise.runtime.parallel.tensor.regions."
                "gather_from_region) for sampling or accuracy"
            )
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
        source = args[0] if args else None
        if (func in _KEEPS_VOCAB and isinstance(result, torch.Tensor) and isinstance(source, torch.Tensor)
                and result.dim() > 0 and result.shape[-1] == source.shape[-1]):
            return VocabShardedLogits.wrap(result, shard)
        return result


def _cross_entropy(shard: VocabShard, input: torch.Tensor, target: torch.Tensor, weight=None,
                   size_average=None, ignore_index: int = -100, reduce=None, reduction: str = "mean",
                   label_smoothing: float = 0.0) -> torch.Tensor:
    if weight is not None or label_smoothing or size_average is not None or reduce is not None:
        raise ValueError("the vocabulary-parallel cross-entropy does not support class weights, label "
                         "smoothing or the deprecated size_average/reduce arguments")
    if target.is_floating_point():
        raise ValueError("the vocabulary-parallel cross-entropy needs class-index targets, not probabilities")
    return vocab_parallel_cross_entropy(input, target, shard, ignore_index, reduction)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int | None = None,
                   num_items_in_batch: torch.Tensor | int | None = None, ignore_index: int = -100,
                   shift_labels: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
    """Hugging Face's causal-LM loss (shift by one, ignore -100, optional division by
    `num_items_in_batch`) on vocabulary-sharded logits; installed as the model's
    `loss_function`, so `model(input_ids, labels=labels).loss` is right under TP."""
    if not isinstance(logits, VocabShardedLogits):
        raise TypeError("causal_lm_loss expects the vocabulary-parallel head's logits")
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    shift_labels = shift_labels.reshape(-1).to(logits.device)
    flat = logits.float().reshape(-1, logits.shape[-1])
    if num_items_in_batch is None:
        return vocab_parallel_cross_entropy(flat, shift_labels, logits.vocab_shard, ignore_index, "mean")
    total = vocab_parallel_cross_entropy(flat, shift_labels, logits.vocab_shard, ignore_index, "sum")
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch
