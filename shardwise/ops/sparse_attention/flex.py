"""Block-sparse attention on CUDA: `flex_attention` with a block mask built from the layout.

`flex_attention` skips the tiles a `BlockMask` marks empty and applies `mask_mod`
elementwise inside the others, so the layout, causality, the sequence's end and the
key-padding mask all become one `mask_mod`, and additive masks a `score_mod`. Its
compiled kernel has forward and backward on CUDA; on CPU torch 2.13 has no backward
("FlexAttention does not support backward on CPU"), which is why the CPU path is
block_sparse.py. The eager (uncompiled) call runs anywhere, forward only on CPU, which
is what lets the tests check this mask construction without a GPU.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from shardwise.ops.sparse_attention.block_sparse import Masks


@functools.cache
def _compiled_flex() -> Callable[..., torch.Tensor]:
    return torch.compile(flex_attention, dynamic=False)


def layout_block_mask(layout: torch.Tensor, block: int, masks: Masks, batch: int, length: int,
                      device: torch.device) -> BlockMask:
    """The layout (heads, blocks, blocks), causality, the sequence end and the boolean key
    padding as one `BlockMask` over `length` tokens."""
    keep_blocks = layout.to(device=device, dtype=torch.bool)
    key_keep = masks.key_keep.to(device) if masks.key_keep is not None else None
    seq_len, causal = masks.seq_len, masks.causal

    def mask_mod(b, h, q_idx, kv_idx):
        keep = keep_blocks[h, q_idx // block, kv_idx // block] & (kv_idx < seq_len)
        if causal:
            keep = keep & (kv_idx <= q_idx)
        if key_keep is not None:
            keep = keep & key_keep[b, kv_idx]
        return keep

    return create_block_mask(mask_mod, batch, layout.shape[0], length, length, device=device)


def _score_mod(masks: Masks, device: torch.device) -> Callable | None:
    bias = masks.bias.to(device) if masks.bias is not None else None
    key_bias = masks.key_bias.to(device) if masks.key_bias is not None else None
    if bias is None and key_bias is None:
        return None
    per_batch = bias is not None and bias.shape[0] > 1
    per_head = bias is not None and bias.shape[1] > 1

    def score_mod(score, b, h, q_idx, kv_idx):
        if bias is not None:
            score = score + bias[b if per_batch else 0, h if per_head else 0, q_idx, kv_idx]
        if key_bias is not None:
            score = score + key_bias[b, kv_idx]
        return score

    return score_mod


def flex_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: torch.Tensor, block: int,
                          masks: Masks, scale: float | None = None, compiled: bool = True) -> torch.Tensor:
    """(B, H, L, d) attention restricted to `layout`; `compiled` False runs flex eagerly."""
    batch, heads, length, dim = q.shape
    padded = layout.shape[-1] * block
    if length < padded:
        q, k, v = (torch.nn.functional.pad(t, (0, 0, 0, padded - length)) for t in (q, k, v))
    block_mask = layout_block_mask(layout, block, masks, batch, padded, q.device)
    attend = _compiled_flex() if compiled else flex_attention
    out = attend(q, k, v, score_mod=_score_mod(masks, q.device), block_mask=block_mask,
                 scale=dim ** -0.5 if scale is None else scale)
    return out[:, :, :length]
