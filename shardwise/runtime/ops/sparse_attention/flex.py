"""Block-sparse attention on CUDA: `flex_attention` with a block mask built from the layout.

`flex_attention` skips the tiles a `BlockMask` marks empty, runs the tiles it marks full
without masking, and applies `mask_mod` elementwise inside the others; the layout,
causality, the sequence's end and the key-padding mask all become one `mask_mod`, and
additive masks a `score_mod`. Its compiled kernel has forward and backward on CUDA; on
CPU torch 2.13 has no backward ("FlexAttention does not support backward on CPU"), which
is why the CPU path is block_sparse.py. The eager (uncompiled) call runs anywhere, forward
only on CPU, which is what lets the tests check this mask construction without a GPU.

The block mask is built from the layout's blocks directly (`BlockMask.from_kv_blocks`:
which flex tiles a kept layout block touches, and which are wholly kept), so building it
costs the layout's size, not L x L as `create_block_mask` would evaluating `mask_mod` at
every position. It depends only on the layout, the length, the masks' structure and the
device, so it is built once per combination and kept in a small cache (least recently
used dropped beyond `CACHE_SIZE`), shared by every layer with the same layout; only a
key-padding mask, which changes with each batch, is bound per call.
"""

from __future__ import annotations

import copy
import functools
from collections import OrderedDict
from typing import Callable

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from shardwise.runtime.ops.sparse_attention.block_sparse import Masks

FLEX_BLOCK = 128  # flex_attention's tile: the block mask's granularity, whatever the layout's block
CACHE_SIZE = 16
# flex_attention's CUDA kernel refuses smaller heads; those run the gather path
# (block_sparse.py), which has a backward on every device
FLEX_MIN_HEAD_DIM = 16


@functools.cache
def _compiled_flex() -> Callable[..., torch.Tensor]:
    return torch.compile(flex_attention, dynamic=False)


def layout_mask_mod(keep_blocks: torch.Tensor, block: int, seq_len: int, causal: bool,
                    key_keep: torch.Tensor | None = None) -> Callable:
    """The elementwise mask: the token pair's layout block is kept, the key is inside the
    sequence (and not after the query, with `causal`; and not padding, with `key_keep`)."""

    def mask_mod(b, h, q_idx, kv_idx):
        keep = keep_blocks[h, q_idx // block, kv_idx // block] & (kv_idx < seq_len)
        if causal:
            keep = keep & (kv_idx <= q_idx)
        if key_keep is not None:
            keep = keep & key_keep[b, kv_idx]
        return keep

    return mask_mod


def layout_block_mask(layout: torch.Tensor, block: int, seq_len: int, causal: bool, length: int,
                      device: torch.device, whole_tiles: bool = True) -> BlockMask:
    """The `BlockMask` of a (heads, blocks, blocks) layout over `length` (= blocks x block)
    tokens, from the layout's blocks: a flex tile is visited when a kept layout block
    overlaps it (and causality and the sequence's end leave keys in it), and is full when
    every pair in it is kept (`whole_tiles` False: never, as with a key-padding mask)."""
    keep = layout.to(device="cpu", dtype=torch.bool)
    heads, blocks, _ = keep.shape
    tiles = -(-length // FLEX_BLOCK)
    tokens = torch.arange(length)
    cover = torch.zeros(tiles, blocks)  # which layout blocks each tile's tokens fall in
    cover[tokens // FLEX_BLOCK, tokens // block] = 1.0
    kept = torch.einsum("ia,hab,jb->hij", cover, keep.float(), cover)  # kept layout blocks per tile
    touched = cover.sum(1)
    rows, columns = torch.arange(tiles).unsqueeze(1), torch.arange(tiles).unsqueeze(0)
    visited = (kept > 0) & (columns * FLEX_BLOCK < seq_len)
    whole = (kept == touched[:, None] * touched[None, :]) & ((columns + 1) * FLEX_BLOCK <= seq_len)
    if causal:
        visited &= columns <= rows
        whole &= columns < rows
    full = visited & whole if whole_tiles else torch.zeros_like(visited)
    partial = visited & ~full
    return BlockMask.from_kv_blocks(
        *_ordered(partial), *_ordered(full), BLOCK_SIZE=FLEX_BLOCK,
        mask_mod=layout_mask_mod(keep.to(device), block, seq_len, causal), seq_lengths=(length, length),
    ).to(device)


def _ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(count per query tile, key tile indices with the visited ones first), batch of one."""
    counts = tiles.sum(-1, dtype=torch.int32)
    indices = torch.argsort(tiles.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    # contiguous: the CUDA kernel reads the lists as if they were (argsort may return
    # another stride order, which the kernel then reads as other tiles' lists)
    return counts.unsqueeze(0).contiguous(), indices.unsqueeze(0).contiguous()


class BlockMaskCache:
    """Block masks by (layout, block, length, masks' structure, device), at most
    `capacity`, the least recently used dropped first; `builds` counts the masks built."""

    def __init__(self, capacity: int = CACHE_SIZE):
        self.capacity = capacity
        self.masks: OrderedDict[tuple, BlockMask] = OrderedDict()
        self.builds = 0

    def get(self, layout: torch.Tensor, block: int, masks: Masks, length: int, device: torch.device) -> BlockMask:
        """The block mask for one call; a key-padding mask is bound to a copy of the cached
        one (the tiles stay those of the layout: padding only removes keys inside them)."""
        padded = masks.key_keep is not None
        contents = layout.to(device="cpu", dtype=torch.bool).contiguous()
        key = (tuple(contents.shape), contents.numpy().tobytes(), block, length, masks.seq_len, masks.causal,
               padded, torch.device(device))
        if key in self.masks:
            self.masks.move_to_end(key)
        else:
            self.masks[key] = layout_block_mask(contents, block, masks.seq_len, masks.causal, length, device,
                                                whole_tiles=not padded)
            self.builds += 1
            if len(self.masks) > self.capacity:
                self.masks.popitem(last=False)
        block_mask = self.masks[key]
        if not padded:
            return block_mask
        bound = copy.copy(block_mask)
        bound.mask_mod = layout_mask_mod(contents.to(device), block, masks.seq_len, masks.causal,
                                         masks.key_keep.to(device))
        return bound


BLOCK_MASKS = BlockMaskCache()


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
                          masks: Masks, *, scale: float | None = None, compiled: bool = True,
                          cache: BlockMaskCache = BLOCK_MASKS) -> torch.Tensor:
    """(B, H, L, d) attention restricted to `layout`; `compiled` False runs flex eagerly."""
    batch, heads, length, dim = q.shape
    padded = layout.shape[-1] * block
    if length < padded:
        q, k, v = (torch.nn.functional.pad(t, (0, 0, 0, padded - length)) for t in (q, k, v))
    block_mask = cache.get(layout, block, masks, padded, q.device)
    attend = _compiled_flex() if compiled else flex_attention
    out = attend(q, k, v, score_mod=_score_mod(masks, q.device), block_mask=block_mask,
                 scale=dim ** -0.5 if scale is None else scale)
    return out[:, :, :length]
