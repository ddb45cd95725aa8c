"""Fused operators and block-sparse attention put into shardwise's GPT and Hugging Face Llama.

Every rewrite keeps the model's Parameter objects and their names: a replaced module
holds the same parameters under the same attribute names (tied embeddings stay tied,
checkpoints load either way), and each parameter is still used inside the forward of the
module that owns it, which is where ZeRO-3 gathers it. The rewrites run in the apply
stage's compile slot (parallel/compile.py), before ZeRO takes the parameters.

GPT: LayerNorm -> FusedLayerNorm, MLP -> bias+GeLU fused into `fc`, the output layer ->
linear + cross-entropy without full logits (`FusedLMHead`), attention -> SparseSelfAttention.
Llama: LlamaRMSNorm -> FusedRMSNorm, LlamaMLP -> fused SwiGLU, attention ->
SparseSelfAttention through transformers' attention interface. Llama's loss is computed by
transformers from full logits and is left alone.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from shardwise.runtime.ops.activations import LinearGeLU, swiglu
from shardwise.runtime.ops.fused_linear_cross_entropy import FusedLMHead
from shardwise.runtime.ops.norms import FusedLayerNorm, FusedRMSNorm
from shardwise.runtime.ops.sparse_attention import SparseSelfAttention, SparsityConfig, seeded_layout

SPARSE_ATTENTION_NAME = "shardwise_sparse"

LayoutFactory = Callable[[int], SparsityConfig]  # number of heads -> layout


def _is_gpt(model: nn.Module) -> bool:
    from shardwise.models.gpt import GPT

    return isinstance(model, GPT)


def _is_llama(model: nn.Module) -> bool:
    return getattr(getattr(model, "config", None), "model_type", None) == "llama"


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, attribute = name.rpartition(".")
    setattr(model.get_submodule(parent_name), attribute, new)


def _refuse(model: nn.Module, key: str) -> None:
    raise ValueError(f"{key}: shardwise can rewrite its own GPT and Hugging Face Llama models, not "
                     f"{type(model).__name__}; remove the key, or apply shardwise.runtime.ops' modules to the model yourself")


class FusedGPTMLP(nn.Module):
    """GPT's MLP with the bias and GeLU of `fc` in one kernel (same `fc` and `proj` parameters)."""

    def __init__(self, fc: LinearGeLU, proj: nn.Linear, dropout: nn.Module):
        super().__init__()
        self.fc, self.proj, self.dropout = fc, proj, dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(self.fc(x)))


class FusedSwiGLUMLP(nn.Module):
    """Llama's MLP, `down(silu(gate(x)) * up(x))`, with the gated unit fused."""

    def __init__(self, gate_proj: nn.Module, up_proj: nn.Module, down_proj: nn.Module):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


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


def use_fused_ops(model: nn.Module) -> nn.Module:
    """Swap in the fused norms, MLP activations and (GPT) the fused output layer + loss."""
    if _is_gpt(model):
        from shardwise.models.gpt import MLP

        for name, module in list(model.named_modules()):
            if type(module) is nn.LayerNorm:
                module.__class__ = FusedLayerNorm  # a subclass with only forward changed: state is shared as is
            elif isinstance(module, MLP):
                fc = LinearGeLU.from_linear(module.fc, approximate="tanh")
                _replace(model, name, FusedGPTMLP(fc, module.proj, module.dropout))
        model.lm_head = FusedLMHead.from_linear(model.lm_head)
        return model
    if _is_llama(model):
        if model.config.hidden_act != "silu":
            raise ValueError(f"compile.fused_ops: the fused SwiGLU needs hidden_act 'silu', not {model.config.hidden_act!r}")
        for name, module in list(model.named_modules()):
            if type(module).__name__ == "LlamaRMSNorm":
                norm = FusedRMSNorm(module.weight.shape[0], module.variance_epsilon)
                norm.weight = module.weight
                _replace(model, name, norm)
            elif type(module).__name__ == "LlamaMLP":
                _replace(model, name, FusedSwiGLUMLP(module.gate_proj, module.up_proj, module.down_proj))
        return model
    _refuse(model, "compile.fused_ops")
    return model


def use_sparse_attention(model: nn.Module, layout: LayoutFactory, seed: int = 0) -> nn.Module:
    """Every attention layer computes only the blocks `layout(num_heads)` keeps (causal).
    Random blocks are drawn under `seed`, layer after layer, so every rank builds the same
    layouts without DeepSpeed's broadcast (which would be a collective inside the forward)."""
    with seeded_layout(seed):
        return _use_sparse_attention(model, layout)


def _sparse(config: SparsityConfig, max_seq_length: int, attn_mask_mode: str = "mul") -> SparseSelfAttention:
    attention = SparseSelfAttention(config, attn_mask_mode=attn_mask_mode, max_seq_length=max_seq_length)
    attention._need_layout_synchronization = False  # seeded: the same on every rank
    return attention


def _use_sparse_attention(model: nn.Module, layout: LayoutFactory) -> nn.Module:
    if _is_gpt(model):
        from shardwise.models.gpt import CausalSelfAttention

        if model.config.dropout > 0:
            raise ValueError("sparse_attention: GPT's attention dropout has no block-sparse version; set dropout 0")
        for name, module in list(model.named_modules()):
            if isinstance(module, CausalSelfAttention):
                sparse = _sparse(layout(module.n_head), model.config.block_size)
                _replace(model, name, SparseCausalSelfAttention(module.qkv, module.proj, module.n_head, sparse))
        return model
    if _is_llama(model):
        _register_hf_attention()
        config = model.config
        for module in model.modules():
            if type(module).__name__ == "LlamaAttention":
                module.sparse_attention = _sparse(layout(config.num_attention_heads), config.max_position_embeddings)
        config._attn_implementation = SPARSE_ATTENTION_NAME
        return model
    _refuse(model, "sparse_attention")
    return model


def _hf_sparse_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                         **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: (B, H, T, d) in, (B, T, H, d) out."""
    if dropout > 0:
        raise ValueError("sparse_attention: attention dropout has no block-sparse version; set attention_dropout 0")
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # grouped-query attention: each key/value head serves `groups` query heads
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    mask = attention_mask[..., : key.shape[-2]] if attention_mask is not None else None
    out = module.sparse_attention(query, key, value, attn_mask=mask, is_causal=True, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _register_hf_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(SPARSE_ATTENTION_NAME, _hf_sparse_attention)
    # sdpa's masks: None when causality alone suffices, else a boolean (batch, 1, T, T) keep-mask.
    ALL_MASK_ATTENTION_FUNCTIONS.register(SPARSE_ATTENTION_NAME, sdpa_mask)
