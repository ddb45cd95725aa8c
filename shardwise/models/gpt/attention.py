"""Attention of shardwise's GPT (model.py) with its heads split, its sequence split, or both.

The model's own `CausalSelfAttention` reads the head width from its input's channels,
which under tensor parallelism are the full width while q, k and v hold 1/N of the heads,
so the plan replaces the module (same parameters, same arithmetic) rather than editing the
model. Tensor parallelism: `qkv` is column-parallel with q, k and v split per block, so a
rank keeps whole heads; `proj` is row-parallel. Ulysses: the heads a rank computes are
further exchanged for the whole sequence by an all-to-all before attention, and back after.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.runtime.distributed.collectives import Communicator
from shardwise.runtime.parallel.sequence.all_to_all import heads_to_sequence, sequence_to_heads


class ParallelCausalSelfAttention(nn.Module):
    def __init__(self, qkv: nn.Module, proj: nn.Module, n_head: int, head_dim: int, dropout: float):
        """`qkv` and `proj` are the (possibly tensor-parallel) projections; `n_head` the
        heads this rank computes before any Ulysses exchange."""
        super().__init__()
        self.qkv, self.proj = qkv, proj
        self.n_head, self.head_dim, self.dropout = n_head, head_dim, dropout
        self.ulysses: Communicator | None = None  # set by the Ulysses transform

    @classmethod
    def replacing(cls, module: nn.Module, qkv: nn.Module, proj: nn.Module, tensor_size: int) -> "ParallelCausalSelfAttention":
        head_dim = module.qkv.in_features // module.n_head
        return cls(qkv, proj, module.n_head // tensor_size, head_dim, module.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch = x.shape[0]
        width = self.n_head * self.head_dim
        q, k, v = (t.unflatten(-1, (self.n_head, self.head_dim)) for t in self.qkv(x).split(width, dim=-1))
        if self.ulysses is not None:
            q, k, v = (sequence_to_heads(t, self.ulysses) for t in (q, k, v))
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           dropout_p=dropout, is_causal=True).transpose(1, 2)
        if self.ulysses is not None:
            y = heads_to_sequence(y, self.ulysses)
        return self.proj(y.reshape(batch, y.shape[1], width))

    def extra_repr(self) -> str:
        sequence = f", Ulysses over {self.ulysses.size} ranks" if self.ulysses is not None else ""
        return f"{self.n_head} local heads of width {self.head_dim}{sequence}"
