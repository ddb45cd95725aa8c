"""Block-sparse attention without a sparse kernel: each query block against its kept key blocks.

A layout keeps, for query block i of head h, a few key blocks. Rows (h, i) that keep the
same number c of blocks form a bucket; for a chunk of such rows the kept key and value
blocks are gathered into a (rows, c·block, d) tensor and `scaled_dot_product_attention`
runs on it, so each query only meets the keys its layout keeps and torch's fused CPU
kernel does the arithmetic. The elementwise masks (causal, padding past the sequence, the
caller's key-padding and attention masks) are gathered alongside.

Forward and backward are one `autograd.Function`: the forward keeps only q, k and v, and
the backward regathers each chunk and recomputes its attention (as activation
checkpointing does) before accumulating the chunk's gradients in place. Peak memory is
therefore q, k, v, the output and their gradients plus one chunk's gathered blocks, and
grows linearly with the sequence; a dense masked attention holds an L x L mask.

This is the CPU path (torch's `flex_attention` has no backward on CPU); CUDA uses
`flex_attention` with a block mask built from the same layout (flex.py).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

# Elements of gathered keys per chunk (per batch row): small enough that a chunk's
# temporaries stay far below an L x L mask, large enough that the loop is not Python-bound.
DEFAULT_CHUNK_ELEMENTS = 1 << 18


@dataclass(frozen=True)
class Chunk:
    rows: torch.Tensor  # (n,) flat row ids h * blocks + i
    key_blocks: torch.Tensor  # (n, c) flat key-block ids h * blocks + j
    query_pos: torch.Tensor  # (n, block) token positions of the rows' queries
    key_pos: torch.Tensor  # (n, c * block) token positions of the gathered keys
    heads: torch.Tensor  # (n,) head of each row

    def to(self, device: torch.device) -> "Chunk":
        return Chunk(*(getattr(self, field.name).to(device) for field in fields(self)))


@dataclass(frozen=True)
class BlockPlan:
    """Which key blocks each query block meets, grouped into chunks of equal width."""

    blocks: int
    block: int
    chunks: tuple[Chunk, ...]  # rows that keep no block are in none: their output stays zero

    @property
    def padded_len(self) -> int:
        return self.blocks * self.block

    def kept_blocks(self) -> int:
        return sum(chunk.key_blocks.numel() for chunk in self.chunks)


def build_plan(layout: torch.Tensor, block: int, causal: bool, head_dim: int,
               chunk_elements: int = DEFAULT_CHUNK_ELEMENTS, device: torch.device | str = "cpu") -> BlockPlan:
    """Chunks for a (heads, blocks, blocks) layout, their index tensors on `device` (where
    the attention runs: the masks index with them). With `causal`, blocks above the
    diagonal are dropped: the causal mask would hide all of their keys."""
    keep = layout.to(torch.bool).cpu()
    heads, blocks, _ = keep.shape
    if causal:
        keep = keep & torch.ones(blocks, blocks, dtype=torch.bool).tril()
    keep = keep.reshape(heads * blocks, blocks)
    counts = keep.sum(dim=1)
    chunks = []
    for width in sorted(set(counts.tolist()) - {0}):
        rows = torch.nonzero(counts == width).flatten()
        head_of_row = rows // blocks
        columns = torch.nonzero(keep[rows])[:, 1].view(len(rows), width)
        per_chunk = max(1, chunk_elements // (width * block * head_dim))
        for start in range(0, len(rows), per_chunk):
            part = slice(start, start + per_chunk)
            chunks.append(_chunk(rows[part], head_of_row[part], columns[part], blocks, block).to(device))
    return BlockPlan(blocks, block, tuple(chunks))


def _chunk(rows: torch.Tensor, heads: torch.Tensor, columns: torch.Tensor, blocks: int, block: int) -> Chunk:
    offsets = torch.arange(block)
    query_pos = (rows % blocks).unsqueeze(1) * block + offsets
    key_pos = (columns.unsqueeze(2) * block + offsets).flatten(1)
    return Chunk(rows, heads.unsqueeze(1) * blocks + columns, query_pos, key_pos, heads)


@dataclass(frozen=True)
class Masks:
    """The elementwise masks, already padded to the plan's length.

    `key_keep` (batch, L) bool; `key_bias` (batch, L) and `bias` (batch | 1, heads | 1, L, L)
    additive floats, with -inf where a mask removes a key."""

    seq_len: int
    causal: bool
    key_keep: torch.Tensor | None = None
    key_bias: torch.Tensor | None = None
    bias: torch.Tensor | None = None

    def for_chunk(self, chunk: Chunk, dtype: torch.dtype) -> torch.Tensor | None:
        """(batch | 1, n, block, c·block): bool when every mask is boolean, else additive."""
        keep = chunk.key_pos.unsqueeze(1) < self.seq_len
        if self.causal:
            keep = keep & (chunk.key_pos.unsqueeze(1) <= chunk.query_pos.unsqueeze(2))
        keep = keep.unsqueeze(0)
        if self.key_keep is not None:
            keep = keep & self.key_keep[:, chunk.key_pos].unsqueeze(2)
        if self.bias is None and self.key_bias is None:
            return None if bool(keep.all()) else keep
        bias = torch.zeros((), dtype=dtype, device=keep.device)
        if self.bias is not None:
            heads = chunk.heads if self.bias.shape[1] > 1 else torch.zeros_like(chunk.heads)
            bias = self.bias[:, heads[:, None, None], chunk.query_pos[:, :, None], chunk.key_pos[:, None, :]].to(dtype)
        if self.key_bias is not None:
            bias = bias + self.key_bias[:, chunk.key_pos].unsqueeze(2).to(dtype)
        return torch.where(keep, bias, torch.tensor(float("-inf"), dtype=dtype, device=keep.device))


def _gather(blocked: tuple[torch.Tensor, ...], chunk: Chunk, plan: BlockPlan) -> tuple[torch.Tensor, ...]:
    """Queries (B, n, block, d), keys and values (B, n, c·block, d) of one chunk."""
    q, k, v = blocked
    width = chunk.key_blocks.shape[1]
    rows, flat = chunk.rows, chunk.key_blocks.flatten()
    batch, _, _, dim = q.shape
    return (
        q.index_select(1, rows),
        k.index_select(1, flat).view(batch, len(rows), width * plan.block, dim),
        v.index_select(1, flat).view(batch, len(rows), width * plan.block, dim),
    )


def _blocked(t: torch.Tensor, plan: BlockPlan) -> torch.Tensor:
    """(B, H, L, d) -> (B, H * blocks, block, d), zero-padded to a whole number of blocks."""
    batch, heads, length, dim = t.shape
    if length < plan.padded_len:
        t = F.pad(t, (0, 0, 0, plan.padded_len - length))
    return t.reshape(batch, heads * plan.blocks, plan.block, dim)


class _BlockSparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockPlan, masks: Masks,
                scale: float) -> torch.Tensor:
        ctx.save_for_backward(q, k, v)
        ctx.plan, ctx.masks, ctx.scale = plan, masks, scale
        blocked = tuple(_blocked(t, plan) for t in (q, k, v))
        out = torch.zeros_like(blocked[0])
        for chunk in plan.chunks:
            q_rows, keys, values = _gather(blocked, chunk, plan)
            mask = masks.for_chunk(chunk, q.dtype)
            out[:, chunk.rows] = F.scaled_dot_product_attention(
                q_rows, keys, values, attn_mask=mask, scale=scale
            )
        batch, heads, length, dim = q.shape
        return out.view(batch, heads, plan.padded_len, dim)[:, :, :length]

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        q, k, v = ctx.saved_tensors
        plan, masks, scale = ctx.plan, ctx.masks, ctx.scale
        blocked = tuple(_blocked(t, plan) for t in (q, k, v))
        grad_blocked = _blocked(grad_out.contiguous(), plan)
        grads = [torch.zeros_like(t) for t in blocked]
        for chunk in plan.chunks:
            rows, flat = chunk.rows, chunk.key_blocks.flatten()
            mask = masks.for_chunk(chunk, q.dtype)
            with torch.enable_grad():
                inputs = [t.detach().requires_grad_() for t in _gather(blocked, chunk, plan)]
                out = F.scaled_dot_product_attention(*inputs, attn_mask=mask, scale=scale)
                dq, dk, dv = torch.autograd.grad(out, inputs, grad_blocked.index_select(1, rows))
            batch, dim = q.shape[0], q.shape[3]
            grads[0].index_add_(1, rows, dq)
            grads[1].index_add_(1, flat, dk.reshape(batch, -1, plan.block, dim))
            grads[2].index_add_(1, flat, dv.reshape(batch, -1, plan.block, dim))
        batch, heads, length, dim = q.shape
        dq, dk, dv = (g.view(batch, heads, plan.padded_len, dim)[:, :, :length] for g in grads)
        return dq, dk, dv, None, None, None


def block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockPlan, masks: Masks,
                           scale: float | None = None) -> torch.Tensor:
    """Attention of (B, H, L, d) queries over the key blocks `plan` keeps, under `masks`."""
    if q.shape != k.shape or k.shape != v.shape:
        raise ValueError(f"block-sparse attention is self-attention: q {tuple(q.shape)}, k {tuple(k.shape)} and "
                         f"v {tuple(v.shape)} must have one shape")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _BlockSparseAttention.apply(q, k, v, plan, masks, scale)
