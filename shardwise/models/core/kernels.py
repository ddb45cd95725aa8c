"""What every model family's kernel rewrites share (gpt/kernels.py, hf.py, llama.py).

A rewrite keeps the model's Parameter objects and their names: a replaced module holds
the same parameters under the same attribute names, and each parameter is still used
inside the forward of the module that owns it, which is where ZeRO-3 gathers it.
"""

from __future__ import annotations

from torch import nn

from shardwise.runtime.ops.sparse_attention import SparseSelfAttention, SparsityConfig


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, attribute = name.rpartition(".")
    setattr(model.get_submodule(parent_name), attribute, new)


def layer_sparse_attention(config: SparsityConfig, max_seq_length: int, attn_mask_mode: str = "mul"
                           ) -> SparseSelfAttention:
    """A layer's `SparseSelfAttention`. Its random blocks are drawn under the kernel
    policy's seed (models/parallelize.py), layer after layer, so every rank builds the same
    layouts without DeepSpeed's broadcast, which would be a collective inside the forward."""
    attention = SparseSelfAttention(config, attn_mask_mode=attn_mask_mode, max_seq_length=max_seq_length)
    attention._need_layout_synchronization = False
    return attention
