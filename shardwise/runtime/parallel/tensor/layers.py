"""Tensor-parallel layers that hold their local shard as a plain `nn.Parameter`.

Each layer is built from the module it replaces (an `nn.Linear`, Hugging Face's `Conv1D`
with its transposed (in, out) weight, or an `nn.Embedding`) and keeps only this rank's
block of each weight. ZeRO, which runs after the parallelize steps, then sees ordinary local
parameters and packs them into its flat units like any others; nothing in ZeRO knows the
model is tensor-parallel.

    ColumnParallelLinear   output features split: y_r = x W_r^T + b_r (no communication
                           unless it enters the region itself or gathers its output)
    RowParallelLinear      input features split: y = sum_r x_r W_r^T, then + b (replicated)
    VocabParallelEmbedding vocabulary rows split: rows outside this rank's range give 0,
                           summed over the group
    VocabParallelHead      the output layer: a column-parallel linear over the vocabulary
                           whose logits stay sharded (cross_entropy.py takes the loss)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.runtime.distributed.collectives import Communicator
from shardwise.runtime.ops.region_collectives import register_communicator
from shardwise.runtime.parallel.tensor.cross_entropy import VocabShard, VocabShardedLogits
from shardwise.runtime.parallel.tensor import sequence_gather
from shardwise.runtime.parallel.tensor.placement import shard_parameter
from shardwise.runtime.parallel.tensor.regions import enter_region, gather_from_region, leave_region


@dataclass(frozen=True)
class TensorRegion:
    """The tensor group a layer splits over, and whether Megatron sequence parallelism
    shards the activations between its regions."""

    comm: Communicator
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        register_communicator(self.comm)  # reachable from a compiled block's region operators

    @property
    def size(self) -> int:
        return self.comm.size

    @property
    def rank(self) -> int:
        return self.comm.rank


class ShardCache:
    """Parameters already split, by identity: a parameter tied between two modules
    (embedding and output layer) is split once, and both must split it the same way."""

    def __init__(self) -> None:
        self._made: dict[int, tuple[int, int | tuple[int, ...]]] = {}

    def shard(self, param: nn.Parameter, dim: int, blocks: int | tuple[int, ...],
              region: TensorRegion) -> nn.Parameter:
        key = (dim, blocks)
        made = self._made.get(id(param))
        if made is not None:
            if made != key:
                raise ValueError("a parameter tied between two modules is split differently by each "
                                 f"(dimension/blocks {made} vs {key}); give both the same style")
            return param
        self._made[id(param)] = key
        return shard_parameter(param, dim, blocks, region.rank, region.size)


def _weight_of(module: nn.Module) -> tuple[torch.Tensor, bool]:
    """The weight and whether it is stored (in, out) as Hugging Face's Conv1D does."""
    conv1d = type(module).__name__ == "Conv1D"
    if not conv1d and not isinstance(module, nn.Linear):
        raise TypeError(f"expected nn.Linear or Conv1D, got {type(module).__name__}")
    return module.weight, conv1d


class ColumnParallelLinear(nn.Module):
    """Output features split over the tensor group (`blocks` > 1: a fused projection whose
    `blocks` equal parts, e.g. q, k and v, are each split; a tuple: parts of those lengths,
    as q, k, v with fewer key/value heads than query heads)."""

    def __init__(self, module: nn.Module, region: TensorRegion, cache: ShardCache, blocks: int | tuple[int, ...] = 1,
                 enter: bool = True, gather_output: bool = False):
        super().__init__()
        weight, self.conv1d = _weight_of(module)
        out_dim = 1 if self.conv1d else 0
        self.region, self.enter, self.gather_output = region, enter, gather_output
        self.weight = cache.shard(weight, out_dim, blocks, region)
        bias = getattr(module, "bias", None)
        self.bias = cache.shard(bias, 0, blocks, region) if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.enter:
            x = enter_region(x, self.region.comm, self.region.sequence_parallel)
        weight = self.weight.t() if self.conv1d else self.weight
        y = sequence_gather.linear(x, weight, self.bias)  # saves only the sequence shard of a gathered input
        return gather_from_region(y, self.region.comm) if self.gather_output else y

    def extra_repr(self) -> str:
        return f"local weight {tuple(self.weight.shape)}, tensor group of {self.region.size}"


class RowParallelLinear(nn.Module):
    """Input features split over the tensor group; the output is summed over it (with
    sequence parallelism: summed and left sharded along the sequence). The bias is
    replicated and added once, after the sum."""

    def __init__(self, module: nn.Module, region: TensorRegion, cache: ShardCache):
        super().__init__()
        weight, self.conv1d = _weight_of(module)
        in_dim = 0 if self.conv1d else 1
        self.region = region
        self.weight = cache.shard(weight, in_dim, 1, region)
        self.bias = module.bias if getattr(module, "bias", None) is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight.t() if self.conv1d else self.weight
        y = leave_region(F.linear(x, weight), self.region.comm, self.region.sequence_parallel)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"local weight {tuple(self.weight.shape)}, tensor group of {self.region.size}"


class VocabParallelEmbedding(nn.Module):
    """Rows [start, stop) of the embedding table; a token outside the range contributes
    zeros, and the all-reduce over the group gives every rank the full embedding."""

    def __init__(self, module: nn.Embedding, region: TensorRegion, cache: ShardCache):
        super().__init__()
        if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
            raise ValueError("vocabulary-parallel embedding supports plain embeddings only "
                             "(no max_norm, scale_grad_by_freq or sparse)")
        self.region = region
        self.weight = cache.shard(module.weight, 0, 1, region)
        self.vocab_size = module.num_embeddings
        self.start = region.rank * self.weight.shape[0]
        local = None if module.padding_idx is None else module.padding_idx - self.start
        self.padding_idx = local if local is not None and 0 <= local < self.weight.shape[0] else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        embedded = F.embedding(local.masked_fill(outside, 0), self.weight, self.padding_idx)
        embedded = embedded.masked_fill(outside.unsqueeze(-1), 0.0)
        return leave_region(embedded, self.region.comm, False)

    def extra_repr(self) -> str:
        return f"rows {self.start}-{self.start + self.weight.shape[0]} of {self.vocab_size}"


class VocabParallelHead(nn.Module):
    """The output layer, split over the vocabulary. Its logits stay sharded
    (`VocabShardedLogits`): `F.cross_entropy` on them, or the Hugging Face loss that
    shardwise installs, computes the loss without gathering them. With `gather_logits`
    (an engine without an optimizer: its callers sample, or take log-probabilities) every
    rank gets the whole logits."""

    gather_logits = False

    def __init__(self, module: nn.Module, region: TensorRegion, cache: ShardCache):
        super().__init__()
        weight, self.conv1d = _weight_of(module)
        self.region = region
        self.weight = cache.shard(weight, 1 if self.conv1d else 0, 1, region)
        bias = getattr(module, "bias", None)
        self.bias = cache.shard(bias, 0, 1, region) if bias is not None else None
        self.local_vocab = self.weight.shape[1 if self.conv1d else 0]
        self.shard = VocabShard(region.comm, region.rank * self.local_vocab, self.local_vocab * region.size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = enter_region(x, self.region.comm, self.region.sequence_parallel)
        weight = self.weight.t() if self.conv1d else self.weight
        logits = F.linear(x, weight, self.bias)
        if self.gather_logits:
            return gather_from_region(logits, self.region.comm)
        return VocabShardedLogits.wrap(logits, self.shard)

    def extra_repr(self) -> str:
        return f"vocabulary {self.shard.start}-{self.shard.start + self.local_vocab} of {self.shard.vocab_size}"


def gather_vocab_logits(model: nn.Module) -> None:
    """Make every vocabulary-parallel output layer of `model` hand back whole logits."""
    for module in model.modules():
        if isinstance(module, VocabParallelHead):
            module.gather_logits = True
