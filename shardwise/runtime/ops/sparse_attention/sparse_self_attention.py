"""`SparseSelfAttention`: DeepSpeed's module, forward and backward on CPU and CUDA.

The constructor and `forward(query, key, value, rpe, key_padding_mask, attn_mask)` have
DeepSpeed's names and mask conventions: "mul" masks keep entries that are non-zero,
"add" masks are added to the scores (0 keeps, -inf removes); `rpe` is added too. Three
differences, each a relaxation: any dtype (DeepSpeed's Triton kernels are fp16 only),
sequence lengths that are not a multiple of the block (the last block is padded and its
padding masked), and `is_causal=True` for an elementwise causal mask (DeepSpeed leaves
that to an `attn_mask`, whose L x L size this avoids).

Random layouts must be identical on every rank. Like DeepSpeed, the layout is broadcast
from rank 0 on first use when a process group is up and the layout has random blocks;
the kernel step of a model's `parallelize` instead builds layouts under a fixed seed (`seeded_layout`), which needs
no collective.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardwise.runtime.distributed.staging import group_device, staged_on
from shardwise.runtime.ops.sparse_attention.block_sparse import BlockPlan, Masks, block_sparse_attention, build_plan
from shardwise.runtime.ops.sparse_attention.flex import FLEX_MIN_HEAD_DIM, flex_sparse_attention
from shardwise.runtime.ops.sparse_attention.sparsity_config import SparsityConfig

MASK_MODES = ("add", "mul")


@contextlib.contextmanager
def seeded_layout(seed: int) -> Iterator[None]:
    """Python's `random` seeded for a layout, its previous state restored afterwards."""
    state = random.getstate()
    random.seed(seed)
    try:
        yield
    finally:
        random.setstate(state)


def _round_up(length: int, block: int) -> int:
    return -(-length // block) * block


class SparseSelfAttention(nn.Module):
    def __init__(self, sparsity_config: SparsityConfig, key_padding_mask_mode: str = "add",
                 attn_mask_mode: str = "mul", max_seq_length: int = 2048):
        super().__init__()
        for name, mode in (("key_padding_mask_mode", key_padding_mask_mode), ("attn_mask_mode", attn_mask_mode)):
            if mode not in MASK_MODES:
                raise ValueError(f"{name} {mode!r} is not a mask mode: use 'add' or 'mul'")
        self.sparsity_config = sparsity_config
        self.key_padding_mask_mode = key_padding_mask_mode
        self.attn_mask_mode = attn_mask_mode
        self.max_seq_length = max_seq_length
        # A plain attribute, not a buffer: the layout is rebuilt from the config, so it
        # stays out of checkpoints and out of ZeRO's parameter and buffer handling.
        self.master_layout = sparsity_config.make_layout(_round_up(max_seq_length, sparsity_config.block))
        self._need_layout_synchronization = getattr(sparsity_config, "num_random_blocks", 0) > 0
        self._plans: dict[tuple[int, bool, int, torch.device], BlockPlan] = {}

    def extra_repr(self) -> str:
        return f"{type(self.sparsity_config).__name__}, block={self.sparsity_config.block}, " \
               f"max_seq_length={self.max_seq_length}"

    def get_layout(self, length: int) -> torch.Tensor:
        """The master layout cut to the blocks `length` tokens occupy."""
        if self._need_layout_synchronization and dist.is_initialized() and dist.get_world_size() > 1:
            with staged_on(self.master_layout, group_device(dist.group.WORLD)) as layout:  # built on the CPU
                dist.broadcast(layout, src=0)
        self._need_layout_synchronization = False
        blocks = _round_up(length, self.sparsity_config.block) // self.sparsity_config.block
        if blocks > self.master_layout.shape[-1]:
            raise ValueError(f"sequence length {length} is longer than max_seq_length {self.max_seq_length} "
                             "this SparseSelfAttention was built for: build it with a larger max_seq_length")
        return self.master_layout[:, :blocks, :blocks]

    def plan(self, length: int, causal: bool, head_dim: int, device: torch.device | str = "cpu") -> BlockPlan:
        key = (length, causal, head_dim, torch.device(device))
        if key not in self._plans:
            self._plans[key] = build_plan(self.get_layout(length), self.sparsity_config.block, causal, head_dim,
                                          device=device)
        return self._plans[key]

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rpe: torch.Tensor | None = None,
                key_padding_mask: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None, *,
                is_causal: bool = False, scale: float | None = None) -> torch.Tensor:
        """Attention of (batch, heads, L, head_dim) tensors; the key may also come
        transposed, (batch, heads, head_dim, L), as DeepSpeed accepts. DeepSpeed's
        arguments; shardwise's own, `is_causal` and `scale` (default head_dim ** -0.5),
        by keyword."""
        batch, heads, length, dim = query.shape
        if key.shape[-2] != length:
            key = key.transpose(-2, -1)
        if heads != self.sparsity_config.num_heads:
            raise ValueError(f"query has {heads} heads but the sparsity config was built for "
                             f"num_heads={self.sparsity_config.num_heads}")
        masks = self._masks(query, length, is_causal, rpe, key_padding_mask, attn_mask)
        if query.is_cuda and dim >= FLEX_MIN_HEAD_DIM:
            layout = self.get_layout(length)
            return flex_sparse_attention(query, key, value, layout, self.sparsity_config.block, masks, scale=scale)
        return block_sparse_attention(query, key, value, self.plan(length, is_causal, dim, query.device), masks,
                                      scale)

    def _masks(self, query: torch.Tensor, length: int, causal: bool, rpe: torch.Tensor | None,
               key_padding_mask: torch.Tensor | None, attn_mask: torch.Tensor | None) -> Masks:
        padded = _round_up(length, self.sparsity_config.block)
        key_keep = key_bias = None
        if key_padding_mask is not None:
            flat = key_padding_mask.reshape(key_padding_mask.shape[0], -1)
            if flat.shape[1] != length:
                raise ValueError(f"key_padding_mask {tuple(key_padding_mask.shape)} does not have one entry per "
                                 f"key: expected (batch, {length})")
            if self.key_padding_mask_mode == "mul":
                key_keep = F.pad(flat != 0, (0, padded - length))
            else:
                key_bias = F.pad(flat.to(query.dtype), (0, padded - length))
        bias = None
        for name, extra, mode in (("attn_mask", attn_mask, self.attn_mask_mode), ("rpe", rpe, "add")):
            if extra is None:
                continue
            if extra.requires_grad:
                raise ValueError(f"{name} requires grad: it is used as a constant mask; detach it")
            term = _as_4d(extra, name, length)
            if mode == "mul":
                term = torch.where(term == 0, float("-inf"), 0.0).to(query.dtype)
            term = F.pad(term.to(query.dtype), (0, padded - length, 0, padded - length))
            bias = term if bias is None else bias + term
        return Masks(seq_len=length, causal=causal, key_keep=key_keep, key_bias=key_bias, bias=bias)


def _as_4d(mask: torch.Tensor, name: str, length: int) -> torch.Tensor:
    """(L, L), (B, L, L) taken as per batch, or (B | 1, H | 1, L, L)."""
    if mask.shape[-2:] != (length, length) or mask.dim() > 4:
        raise ValueError(f"{name} {tuple(mask.shape)} must end in ({length}, {length}) and have at most 4 dims")
    if mask.dim() == 3:
        mask = mask.unsqueeze(1)
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    return mask
