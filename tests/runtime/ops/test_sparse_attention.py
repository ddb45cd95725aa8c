"""SparseSelfAttention equals dense attention under the same mask, forward and backward (C20).

The reference is torch's dense `scaled_dot_product_attention` with the layout expanded to
an L x L boolean mask, intersected with the causal and padding masks: what the sparse
computation must reproduce while computing only the kept blocks.
"""

import random

import pytest
import torch
import torch.nn.functional as F

from shardwise.runtime.ops.sparse_attention import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    SparseSelfAttention,
    VariableSparsityConfig,
)
from shardwise.runtime.ops.sparse_attention.flex import flex_sparse_attention

HEADS, DIM, BLOCK = 2, 8, 4

CONFIGS = {
    "fixed": lambda attention: FixedSparsityConfig(HEADS, block=BLOCK, num_local_blocks=2, attention=attention),
    "bigbird": lambda attention: BigBirdSparsityConfig(HEADS, block=BLOCK, different_layout_per_head=True,
                                                       attention=attention),
    "bslongformer": lambda attention: BSLongformerSparsityConfig(HEADS, block=BLOCK, global_block_indices=[2],
                                                                 attention=attention),
    "variable": lambda attention: VariableSparsityConfig(HEADS, block=BLOCK, num_random_blocks=1,
                                                         local_window_blocks=[1, 3], attention=attention),
    "dense": lambda attention: DenseSparsityConfig(HEADS, block=BLOCK),
}


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def dense_mask(layout: torch.Tensor, length: int, causal: bool, key_keep: torch.Tensor | None) -> torch.Tensor:
    mask = layout.bool().repeat_interleave(BLOCK, 1).repeat_interleave(BLOCK, 2)[:, :length, :length].unsqueeze(0)
    if causal:
        mask = mask & torch.ones(length, length, dtype=torch.bool).tril()
    if key_keep is not None:
        mask = mask & key_keep[:, None, None, :]
    return mask


def qkv(length: int, batch: int = 2, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, HEADS, length, DIM, generator=generator, requires_grad=True) for _ in range(3)]


def forward_backward(fn, tensors):
    out = fn(*tensors)
    grad = torch.cos(torch.arange(out.numel(), dtype=out.dtype)).view_as(out)
    return [out, *torch.autograd.grad(out, tensors, grad)]


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("length", [24, 22])  # 22: the last block is half padding
def test_forward_and_gradients_equal_dense_attention_with_the_same_mask(name, causal, length):
    random.seed(3)
    attention = SparseSelfAttention(CONFIGS[name]("unidirectional" if causal else "bidirectional"),
                                    key_padding_mask_mode="mul", max_seq_length=32)
    padding = torch.ones(2, length)
    padding[1, -5:] = 0  # the second sequence is 5 tokens shorter
    tensors = qkv(length)
    sparse = forward_backward(lambda q, k, v: attention(q, k, v, key_padding_mask=padding, is_causal=causal), tensors)
    mask = dense_mask(attention.get_layout(length), length, causal, padding.bool())
    dense = forward_backward(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask), tensors)
    for what, got, want in zip(("output", "dq", "dk", "dv"), sparse, dense):
        assert relative_error(got, want) < 1e-5, what
    if name != "dense":
        plan = attention.plan(length, causal, DIM)
        assert plan.kept_blocks() < HEADS * plan.blocks ** 2  # blocks outside the layout were skipped


def test_additive_and_multiplicative_masks_and_rpe_follow_deepspeeds_conventions():
    length = 20
    random.seed(0)
    config = BigBirdSparsityConfig(HEADS, block=BLOCK)
    additive = SparseSelfAttention(config, key_padding_mask_mode="add", attn_mask_mode="add", max_seq_length=32)
    multiplicative = SparseSelfAttention(config, key_padding_mask_mode="mul", attn_mask_mode="mul", max_seq_length=32)
    multiplicative.master_layout = additive.master_layout
    generator = torch.Generator().manual_seed(1)
    keep_pairs = torch.rand(length, length, generator=generator) > 0.2
    keep_pairs.fill_diagonal_(True)
    keep_keys = torch.ones(2, length, dtype=torch.bool)
    keep_keys[0, 3:6] = False
    rpe = torch.randn(length, length, generator=generator)
    tensors = qkv(length, seed=4)

    def additive_call(q, k, v):
        return additive(q, k, v, rpe=rpe, key_padding_mask=torch.zeros(2, length).masked_fill(~keep_keys, -torch.inf),
                        attn_mask=torch.zeros(length, length).masked_fill(~keep_pairs, -torch.inf))

    def multiplicative_call(q, k, v):
        return multiplicative(q, k, v, rpe=rpe, key_padding_mask=keep_keys.float(), attn_mask=keep_pairs.float())

    mask = dense_mask(additive.get_layout(length), length, False, keep_keys) & keep_pairs
    bias = rpe.masked_fill(~mask, -torch.inf)
    dense = forward_backward(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=bias), tensors)
    for call in (additive_call, multiplicative_call):
        for got, want in zip(forward_backward(call, tensors), dense):
            assert relative_error(got, want) < 1e-5


def test_a_query_whose_kept_keys_are_all_masked_gets_zero_output_and_gradient():
    diagonal = LocalSlidingWindowSparsityConfig(HEADS, block=BLOCK, num_sliding_window_blocks=1)
    attention = SparseSelfAttention(diagonal, max_seq_length=16, key_padding_mask_mode="mul")
    padding = torch.ones(1, 16)
    padding[0, 4:8] = 0  # block 1 attends only to itself, and all its keys are padding
    out, dq, _, _ = forward_backward(lambda q, k, v: attention(q, k, v, key_padding_mask=padding), qkv(16, batch=1))
    assert torch.all(out[0, :, 4:8] == 0) and torch.all(dq[0, :, 4:8] == 0)
    assert torch.isfinite(out).all() and out[0, :, :4].abs().sum() > 0


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("causal", [False, True])
def test_flex_attention_block_mask_built_from_the_layout_matches_dense(causal):
    """The CUDA path's mask construction, run with eager flex_attention (forward only on CPU)."""
    random.seed(5)
    attention = SparseSelfAttention(BigBirdSparsityConfig(HEADS, block=BLOCK), max_seq_length=32,
                                    key_padding_mask_mode="mul")
    length = 22
    padding = torch.ones(2, length)
    padding[0, -3:] = 0
    q, k, v = (t.detach() for t in qkv(length))
    masks = attention._masks(q, length, causal, None, padding, None)
    out = flex_sparse_attention(q, k, v, attention.get_layout(length), BLOCK, masks, compiled=False)
    mask = dense_mask(attention.get_layout(length), length, causal, padding.bool())
    assert relative_error(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask)) < 1e-5


def test_misuse_is_refused_with_the_fix():
    attention = SparseSelfAttention(DenseSparsityConfig(HEADS, block=BLOCK), max_seq_length=16)
    q = torch.randn(1, HEADS, 20, DIM)
    with pytest.raises(ValueError, match="larger max_seq_length"):
        attention(q, q, q)
    with pytest.raises(ValueError, match="num_heads=2"):
        attention(*(torch.randn(1, 3, 8, DIM) for _ in range(3)))
    with pytest.raises(ValueError, match="expected \\(batch, 8\\)"):
        q = torch.randn(1, HEADS, 8, DIM)
        attention(q, q, q, key_padding_mask=torch.ones(1, 9))
    with pytest.raises(ValueError, match="mask mode"):
        SparseSelfAttention(DenseSparsityConfig(HEADS), attn_mask_mode="multiply")
