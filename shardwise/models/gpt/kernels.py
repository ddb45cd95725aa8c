"""Fused operators and block-sparse attention put into shardwise's GPT (C19, C20), keeping
its parameters (models/kernels.py): tied embeddings stay tied, checkpoints load either way.

LayerNorm -> FusedLayerNorm, MLP -> bias+GeLU fused into `fc`, the output layer -> linear
+ cross-entropy without full logits (`FusedLMHead`), attention -> SparseSelfAttention.
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.models.gpt.model import MLP, CausalSelfAttention
from shardwise.models.core.kernels import layer_sparse_attention, replace_module
from shardwise.runtime.ops.activations import LinearGeLU
from shardwise.runtime.ops.fused_linear_cross_entropy import FusedLMHead
from shardwise.runtime.ops.norms import FusedLayerNorm
from shardwise.runtime.ops.policy import LayoutFactory
from shardwise.runtime.ops.sparse_attention import SparseSelfAttention


class FusedGPTMLP(nn.Module):
    """GPT's MLP with the bias and GeLU of `fc` in one kernel (same `fc` and `proj` parameters)."""

    def __init__(self, fc: LinearGeLU, proj: nn.Linear, dropout: nn.Module):
        super().__init__()
        self.fc, self.proj, self.dropout = fc, proj, dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(self.fc(x)))


class SparseCausalSelfAttention(nn.Module):
    """GPT's attention (same `qkv` and `proj`) with SparseSelfAttention in place of dense SDPA."""

    def __init__(self, qkv: nn.Module, proj: nn.Module, n_head: int, sparse: SparseSelfAttention):
        super().__init__()
        self.qkv, self.proj, self.n_head, self.sparse = qkv, proj, n_head, sparse

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, channels = x.shape
        shape = (batch, time, self.n_head, channels // self.n_head)
        q, k, v = (t.view(shape).transpose(1, 2) for t in self.qkv(x).split(channels, dim=2))
        y = self.sparse(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, time, channels))


def use_fused_ops(model: nn.Module) -> None:
    """Swap in the fused norms, the fused MLP activation and the fused output layer + loss."""
    for name, module in list(model.named_modules()):
        if type(module) is nn.LayerNorm:
            module.__class__ = FusedLayerNorm  # a subclass with only forward changed: state is shared as is
        elif isinstance(module, MLP):
            fc = LinearGeLU.from_linear(module.fc, approximate="tanh")
            replace_module(model, name, FusedGPTMLP(fc, module.proj, module.dropout))
    model.lm_head = FusedLMHead.from_linear(model.lm_head)


def use_sparse_attention(model: nn.Module, layout: LayoutFactory) -> None:
    """Every attention layer computes only the blocks `layout(num_heads)` keeps (causal)."""
    if model.config.dropout > 0:
        raise ValueError("sparse_attention: GPT's attention dropout has no block-sparse version; set dropout 0")
    for name, module in list(model.named_modules()):
        if isinstance(module, CausalSelfAttention):
            sparse = layer_sparse_attention(layout(module.n_head), model.config.block_size)
            replace_module(model, name, SparseCausalSelfAttention(module.qkv, module.proj, module.n_head, sparse))
