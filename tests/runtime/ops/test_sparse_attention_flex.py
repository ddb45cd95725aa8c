"""The CUDA path's block mask (flex.py), built from the layout's blocks and cached, for
layout blocks smaller than, equal to and larger than flex's 128-token tile: its tiles are
those the elementwise mask asks for (skipped, partly masked, wholly kept); run with eager
`flex_attention`, which torch 2.13 runs forward on CPU (applying `mask_mod` everywhere),
it gives the CPU path's results (block_sparse.py, and dense attention under the same
mask); and the mask is built once per layout, length, masks' structure and device, then
reused."""

import random

import pytest
import torch
import torch.nn.functional as F

from shardwise.runtime.ops.sparse_attention import BigBirdSparsityConfig, FixedSparsityConfig, SparseSelfAttention
from shardwise.runtime.ops.sparse_attention.block_sparse import block_sparse_attention
from shardwise.runtime.ops.sparse_attention.flex import FLEX_BLOCK, BlockMaskCache, flex_sparse_attention
from tests.runtime.ops.test_sparse_attention import relative_error

HEADS, DIM = 2, 8

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def attention_for(block: int, max_length: int, kind: str) -> SparseSelfAttention:
    random.seed(7)
    config = (BigBirdSparsityConfig(HEADS, block=block, num_random_blocks=1, num_sliding_window_blocks=3,
                                    num_global_blocks=1)
              if kind == "bigbird" else
              FixedSparsityConfig(HEADS, block=block, num_local_blocks=4, num_global_blocks=1,
                                  attention="unidirectional"))
    return SparseSelfAttention(config, key_padding_mask_mode="mul", max_seq_length=max_length)


def tensors(length: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(2, HEADS, length, DIM, generator=generator) for _ in range(3)]


@pytest.mark.parametrize(("block", "length", "kind"), [
    (16, 200, "bigbird"),  # 8 layout blocks per tile
    (64, 300, "fixed"),  # 2 per tile, the last tile cut by the padded length
    (128, 256, "bigbird"),  # one per tile
    (256, 600, "fixed"),  # each layout block spans two tiles
])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padding", [False, True])
def test_flex_on_the_layouts_block_mask_equals_the_cpu_path_and_dense_attention(block, length, kind, causal,
                                                                                  padding):
    attention = attention_for(block, 768, kind)
    q, k, v = tensors(length, seed=block + length)
    keep_keys = torch.ones(2, length)
    if padding:
        keep_keys[1, -37:] = 0
    masks = attention._masks(q, length, causal, None, keep_keys if padding else None, None)
    layout = attention.get_layout(length)
    cache = BlockMaskCache()
    out = flex_sparse_attention(q, k, v, layout, block, masks, compiled=False, cache=cache)
    cpu = block_sparse_attention(q, k, v, attention.plan(length, causal, DIM), masks)
    mask = dense_mask_for(layout, block, length, causal, keep_keys.bool())
    dense = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert relative_error(out, cpu) < 1e-5
    assert relative_error(out, dense) < 1e-5
    # eager flex (all there is on CPU) applies mask_mod everywhere and ignores the tiles, so
    # the tiles are checked against the mask itself: every tile holding a kept pair is
    # visited, and a tile is full exactly when every pair in it is kept
    block_mask = next(iter(cache.masks.values()))
    partial, full = (tiles_of(block_mask.kv_num_blocks, block_mask.kv_indices),
                     tiles_of(block_mask.full_kv_num_blocks, block_mask.full_kv_indices))
    any_kept, all_kept = kept_tiles(layout, block, length, causal)
    visited = partial | full
    assert not (partial & full).any() and visited[any_kept].all()
    assert visited.equal(any_kept) or causal  # causal: a tile may hold kept blocks only above the diagonal
    assert full.equal(all_kept & ~torch.tensor(padding))  # a key-padding mask leaves no tile whole
    if kind == "fixed":  # a unidirectional layout: the tiles above the diagonal are skipped
        assert not visited.all()
    if not padding and block >= FLEX_BLOCK:
        assert full.any()  # some tiles run without mask_mod


def test_the_block_masks_tile_lists_are_contiguous_whatever_strides_argsort_returns(monkeypatch):
    """flex's CUDA kernel reads the tile counts and lists as contiguous tensors, whatever
    their strides say. torch 2.11's argsort returned the lists in another stride order (the
    H200 run of 2026-11-28: strides (16, 8, 1, 16) for shape (1, 2, 8, 8)), so the compiled
    kernel read other tiles' lists and was off by 1.7 (relative) while eager flex and the
    CPU were right; torch 2.13's argsort returns them contiguous, so an argsort that answers
    in that transposed order stands in for 2.11's here."""
    from shardwise.runtime.ops.sparse_attention import flex

    def transposed_argsort(tensor, **options):
        order = torch.sort(tensor.transpose(-1, -2).contiguous().transpose(-1, -2), **options).indices
        assert not order.is_contiguous() or order.shape[-1] == 1
        return order

    monkeypatch.setattr(flex.torch, "argsort", transposed_argsort)
    attention = attention_for(128, 1024, "bigbird")
    layout = attention.get_layout(1024).contiguous()
    block_mask = flex.layout_block_mask(layout, 128, 1024, False, 1024, torch.device("cpu"))
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        assert getattr(block_mask, name).is_contiguous(), name
    any_kept, all_kept = kept_tiles(layout, 128, 1024, False)
    assert tiles_of(block_mask.full_kv_num_blocks, block_mask.full_kv_indices).equal(all_kept)
    assert not tiles_of(block_mask.kv_num_blocks, block_mask.kv_indices).any() and all_kept.equal(any_kept)


def tiles_of(counts: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """(heads, tiles, tiles) bool from a block mask's counts and indices (batch of one)."""
    counts, indices = counts[0], indices[0]
    tiles = torch.zeros(*indices.shape, dtype=torch.bool)
    for head in range(indices.shape[0]):
        for row in range(indices.shape[1]):
            tiles[head, row, indices[head, row, : counts[head, row]].long()] = True
    return tiles


def kept_tiles(layout: torch.Tensor, block: int, length: int, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per 128-token tile: whether the elementwise mask keeps any pair, and every pair (of
    the tokens that exist: the padded length's)."""
    padded = layout.shape[-1] * block
    tiles = -(-padded // FLEX_BLOCK)
    keep = layout.bool().repeat_interleave(block, 1).repeat_interleave(block, 2)
    keep = keep & (torch.arange(padded) < length)
    if causal:
        keep = keep & torch.ones(padded, padded, dtype=torch.bool).tril()
    grid = torch.zeros(HEADS, tiles * FLEX_BLOCK, tiles * FLEX_BLOCK, dtype=torch.bool)
    grid[:, :padded, :padded] = keep
    rows_absent = torch.arange(tiles * FLEX_BLOCK) >= padded
    any_kept = grid.view(HEADS, tiles, FLEX_BLOCK, tiles, FLEX_BLOCK).any(4).any(2)
    all_kept = (grid | rows_absent[None, :, None]).view(HEADS, tiles, FLEX_BLOCK, tiles, FLEX_BLOCK).all(4).all(2)
    return any_kept, all_kept


def dense_mask_for(layout: torch.Tensor, block: int, length: int, causal: bool, key_keep: torch.Tensor):
    expanded = layout.bool().repeat_interleave(block, 1).repeat_interleave(block, 2)[:, :length, :length]
    mask = expanded.unsqueeze(0) & key_keep[:, None, None, :]
    if causal:
        mask = mask & torch.ones(length, length, dtype=torch.bool).tril()
    return mask


def test_the_block_mask_is_built_once_per_layout_length_and_masks():
    attention = attention_for(16, 256, "bigbird")
    cache = BlockMaskCache(capacity=2)
    q, k, v = tensors(100, seed=0)
    layout = attention.get_layout(100)

    def forward(causal: bool = False, key_padding=None, length: int = 100):
        masks = attention._masks(q[:, :, :length], length, causal, None, key_padding, None)
        return flex_sparse_attention(q[:, :, :length], k[:, :, :length], v[:, :, :length],
                                     attention.get_layout(length), 16, masks, compiled=False, cache=cache)

    first = forward()
    assert cache.builds == 1
    assert forward().equal(first) and cache.builds == 1  # the second forward hits the cache
    same_layout = layout.clone()  # equal contents, another tensor: still one mask
    masks = attention._masks(q, 100, False, None, None, None)
    flex_sparse_attention(q, k, v, same_layout, 16, masks, compiled=False, cache=cache)
    assert cache.builds == 1
    padding = torch.ones(2, 100)
    padding[0, -9:] = 0
    forward(key_padding=padding)  # its own entry (no tile is wholly kept), then reused with new padding
    padding[1, -20:] = 0
    padded = forward(key_padding=padding)
    assert cache.builds == 2
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask_for(layout, 16, 100, False,
                                                                                padding.bool()))
    assert relative_error(padded, expected) < 1e-5  # the new padding, not the cached call's
    forward(causal=True)  # a third combination: the least recently used (no padding) is dropped
    assert cache.builds == 3 and len(cache.masks) == 2
    forward()
    assert cache.builds == 4
