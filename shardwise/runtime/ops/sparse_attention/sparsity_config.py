"""Block-sparse attention layouts under DeepSpeed's names and parameters.

A layout is a (num_heads, num_blocks, num_blocks) int64 tensor: 1 where query block i
attends to key block j. The classes, their constructor parameters, their defaults, their
errors and the layouts `make_layout` returns follow DeepSpeed's
`deepspeed/ops/sparse_attention/sparsity_config.py`, so a DeepSpeed user's layout is the
same here, random blocks included: they are drawn with Python's `random.sample` in the
same order (head by head, row by row), so under the same `random.seed` both libraries
produce the same layout.

Two details of DeepSpeed's layouts that look surprising and are kept on purpose:
`VariableSparsityConfig` draws its random blocks from the whole row even when the
attention is unidirectional (the elementwise causal mask removes the future ones at run
time), and a unidirectional `BigBirdSparsityConfig` draws them from blocks 0..row, so it
needs `num_random_blocks` <= 1 for its first row.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

ATTENTION_TYPES = ("unidirectional", "bidirectional")


def _check_attention(attention: str) -> None:
    if attention not in ATTENTION_TYPES:
        raise ValueError(f"attention {attention!r} is not an attention type: use 'unidirectional' or 'bidirectional'")


def _check_global_ranges(starts: Sequence[int], ends: Sequence[int] | None) -> None:
    if ends is None:
        return
    if len(starts) != len(ends):
        raise ValueError(
            f"global_block_indices has {len(starts)} entries but global_block_end_indices has {len(ends)}: "
            "give one end index per start index"
        )
    for start, end in zip(starts, ends):
        if start >= end:
            raise ValueError(f"global block range [{start}, {end}) is empty: each end index must exceed its start")


class SparsityConfig(ABC):
    """What every layout shares: the number of heads, the block size, and whether heads
    get layouts of their own (otherwise head 0's layout is copied to all heads)."""

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False):
        if num_heads < 1 or block < 1:
            raise ValueError(f"num_heads ({num_heads}) and block ({block}) must be positive")
        self.num_heads = num_heads
        self.block = block
        self.different_layout_per_head = different_layout_per_head
        self.num_layout_heads = num_heads if different_layout_per_head else 1

    def setup_layout(self, seq_len: int) -> torch.Tensor:
        """An all-zero layout for `seq_len` tokens, which must be a whole number of blocks."""
        if seq_len % self.block != 0:
            raise ValueError(f"sequence length {seq_len} is not a multiple of the block size {self.block}")
        blocks = seq_len // self.block
        return torch.zeros((self.num_heads, blocks, blocks), dtype=torch.int64)

    def make_layout(self, seq_len: int) -> torch.Tensor:
        """The (num_heads, blocks, blocks) layout for `seq_len` tokens."""
        layout = self.setup_layout(seq_len)
        for head in range(self.num_layout_heads):
            self.fill_head(layout[head], head)
        return self.check_and_propagate_first_head_layout(layout)

    def check_and_propagate_first_head_layout(self, layout: torch.Tensor) -> torch.Tensor:
        if not self.different_layout_per_head:
            layout[1:] = layout[0]
        return layout

    @abstractmethod
    def fill_head(self, head_layout: torch.Tensor, head: int) -> None:
        """Set the kept blocks of one head's (blocks, blocks) layout in place."""


class DenseSparsityConfig(SparsityConfig):
    """Every block kept: dense attention expressed as a layout, for comparisons."""

    def fill_head(self, head_layout: torch.Tensor, head: int) -> None:
        head_layout.fill_(1)


def _local_windows(head_layout: torch.Tensor, start: int, stop: int, unidirectional: bool) -> None:
    """Blocks [start, stop) attend to each other (to earlier ones only if unidirectional)."""
    window = head_layout[start:stop, start:stop]
    kept = torch.ones_like(window)
    window.copy_(window | (kept.tril() if unidirectional else kept))


def _sliding_window(head_layout: torch.Tensor, window_blocks: int, unidirectional: bool = False) -> None:
    blocks = head_layout.shape[0]
    if blocks < window_blocks:
        raise ValueError(
            f"num_sliding_window_blocks {window_blocks} is more than the {blocks} blocks of the sequence: "
            "use a longer sequence or a smaller window"
        )
    half = window_blocks // 2
    rows = torch.arange(blocks).unsqueeze(1)
    cols = torch.arange(blocks).unsqueeze(0)
    upper = cols <= rows if unidirectional else cols <= rows + half
    head_layout[(cols >= rows - half) & upper] = 1


def _global_columns_and_rows(head_layout: torch.Tensor, starts: Sequence[int], ends: Sequence[int] | None,
                             horizontal: bool, bidirectional: bool) -> None:
    """Global blocks: every row attends to them (from the block itself on, if causal), and
    with `horizontal` they attend to every block."""
    blocks = head_layout.shape[0]
    ranges = zip(starts, ends) if ends is not None else ((start, start + 1) for start in starts)
    for start, end in ranges:
        if start >= blocks:
            continue
        end = min(end, blocks)
        if horizontal:
            head_layout[start:end, :] = 1
        head_layout[0 if bidirectional else start:, start:end] = 1


class FixedSparsityConfig(SparsityConfig):
    """Sparse Transformer's "fixed" pattern (Child et al. 2019): local windows of
    `num_local_blocks`, the last `num_global_blocks` of each window global to later blocks
    (to all blocks if bidirectional); heads can use different global blocks of the window."""

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False,
                 num_local_blocks: int = 4, num_global_blocks: int = 1, attention: str = "bidirectional",
                 horizontal_global_attention: bool = False, num_different_global_patterns: int = 1):
        super().__init__(num_heads, block, different_layout_per_head)
        if num_local_blocks % num_global_blocks != 0:
            raise ValueError(
                f"num_local_blocks {num_local_blocks} is not divisible by num_global_blocks {num_global_blocks}"
            )
        _check_attention(attention)
        if attention != "bidirectional" and horizontal_global_attention:
            raise ValueError("horizontal_global_attention needs attention 'bidirectional'")
        if num_different_global_patterns > 1 and not different_layout_per_head:
            raise ValueError(
                f"num_different_global_patterns {num_different_global_patterns} needs different_layout_per_head "
                "true: with one layout for all heads there is one global pattern"
            )
        most = num_local_blocks // num_global_blocks
        if num_different_global_patterns > most:
            raise ValueError(
                f"num_different_global_patterns {num_different_global_patterns} is more than num_local_blocks / "
                f"num_global_blocks = {num_local_blocks} / {num_global_blocks} = {most}"
            )
        self.num_local_blocks = num_local_blocks
        self.num_global_blocks = num_global_blocks
        self.attention = attention
        self.horizontal_global_attention = horizontal_global_attention
        self.num_different_global_patterns = num_different_global_patterns

    def fill_head(self, head_layout: torch.Tensor, head: int) -> None:
        blocks = head_layout.shape[0]
        local, width = self.num_local_blocks, self.num_global_blocks
        unidirectional = self.attention == "unidirectional"
        for start in range(0, blocks, local):
            _local_windows(head_layout, start, min(start + local, blocks), unidirectional)
        # Head h uses the (h mod patterns)-th group of global blocks counted from the end of each window.
        offset = local - (1 + head % self.num_different_global_patterns) * width
        whole_windows_end = blocks - blocks % local
        starts = list(range(offset, whole_windows_end, local))
        if whole_windows_end < blocks:  # a short last window still gets its global blocks, shifted to fit
            starts.append(min(whole_windows_end + offset, blocks - width))
        for start in starts:
            head_layout[0 if not unidirectional else start:, start:start + width] = 1
            if self.horizontal_global_attention:
                head_layout[start:start + width, :] = 1


class VariableSparsityConfig(SparsityConfig):
    """The fixed pattern generalised: `num_random_blocks` random blocks per row, windows of
    the sizes in `local_window_blocks` (the last size repeats), global blocks at given
    indices or index ranges."""

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False,
                 num_random_blocks: int = 0, local_window_blocks: Sequence[int] = (4,),
                 global_block_indices: Sequence[int] = (0,), global_block_end_indices: Sequence[int] | None = None,
                 attention: str = "bidirectional", horizontal_global_attention: bool = False):
        super().__init__(num_heads, block, different_layout_per_head)
        _check_global_ranges(global_block_indices, global_block_end_indices)
        _check_attention(attention)
        if attention != "bidirectional" and horizontal_global_attention:
            raise ValueError("horizontal_global_attention needs attention 'bidirectional'")
        if not local_window_blocks:
            raise ValueError("local_window_blocks is empty: give at least one window size")
        self.num_random_blocks = num_random_blocks
        self.local_window_blocks = list(local_window_blocks)
        self.global_block_indices = list(global_block_indices)
        self.global_block_end_indices = None if global_block_end_indices is None else list(global_block_end_indices)
        self.attention = attention
        self.horizontal_global_attention = horizontal_global_attention

    def fill_head(self, head_layout: torch.Tensor, head: int) -> None:
        blocks = head_layout.shape[0]
        if blocks < self.num_random_blocks:
            raise ValueError(f"num_random_blocks {self.num_random_blocks} is more than the {blocks} blocks in a row")
        for row in range(blocks):
            head_layout[row, random.sample(range(blocks), self.num_random_blocks)] = 1
        unidirectional = self.attention == "unidirectional"
        start = 0
        for size in self.local_window_blocks:
            _local_windows(head_layout, start, min(start + size, blocks), unidirectional)
            start += size
        for window_start in range(start, blocks, self.local_window_blocks[-1]):
            _local_windows(head_layout, window_start, min(window_start + self.local_window_blocks[-1], blocks),
                           unidirectional)
        _global_columns_and_rows(head_layout, self.global_block_indices, self.global_block_end_indices,
                                 self.horizontal_global_attention, not unidirectional)


class BigBirdSparsityConfig(SparsityConfig):
    """BigBird (Zaheer et al. 2020): random blocks, a sliding window of
    `num_sliding_window_blocks` and the first `num_global_blocks` global both ways."""

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False,
                 num_random_blocks: int = 1, num_sliding_window_blocks: int = 3, num_global_blocks: int = 1,
                 attention: str = "bidirectional"):
        super().__init__(num_heads, block, different_layout_per_head)
        _check_attention(attention)
        self.num_random_blocks = num_random_blocks
        self.num_sliding_window_blocks = num_sliding_window_blocks
        self.num_global_blocks = num_global_blocks
        self.attention = attention

    def fill_head(self, head_layout: torch.Tensor, head: int) -> None:
        blocks = head_layout.shape[0]
        if blocks < self.num_random_blocks:
            raise ValueError(f"num_random_blocks {self.num_random_blocks} is more than the {blocks} blocks in a row")
        unidirectional = self.attention == "unidirectional"
        for row in range(blocks):
            population = range(row + 1) if unidirectional else range(blocks)
            if len(population) < self.num_random_blocks:
                raise ValueError(
                    f"unidirectional BigBird draws row {row}'s {self.num_random_blocks} random blocks from its "
                    f"{len(population)} earlier blocks: use num_random_blocks <= 1 (as DeepSpeed, which fails here too)"
                )
            head_layout[row, random.sample(population, self.num_random_blocks)] = 1
        _sliding_window(head_layout, self.num_sliding_window_blocks)
        if blocks < self.num_global_blocks:
            raise ValueError(f"num_global_blocks {self.num_global_blocks} is more than the {blocks} blocks in a row")
        head_layout[:self.num_global_blocks, :] = 1
        head_layout[:, :self.num_global_blocks] = 1
        if unidirectional:
            head_layout.copy_(torch.tril(head_layout))


class BSLongformerSparsityConfig(SparsityConfig):
    """Block-sparse Longformer (Beltagy et al. 2020): a sliding window and global blocks at
    given indices or index ranges, global both ways."""

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False,
                 num_sliding_window_blocks: int = 3, global_block_indices: Sequence[int] = (0,),
                 global_block_end_indices: Sequence[int] | None = None, attention: str = "bidirectional"):
        super().__init__(num_heads, block, different_layout_per_head)
        _check_global_ranges(global_block_indices, global_block_end_indices)
        _check_attention(attention)
        self.num_sliding_window_blocks = num_sliding_window_blocks
        self.global_block_indices = list(global_block_indices)
        self.global_block_end_indices = None if global_block_end_indices is None else list(global_block_end_indices)
        self.attention = attention

    def fill_head(self, head_layout: torch.Tensor, head: int) -> None:
        _sliding_window(head_layout, self.num_sliding_window_blocks)
        _global_columns_and_rows(head_layout, self.global_block_indices, self.global_block_end_indices,
                                 horizontal=True, bidirectional=True)
        if self.attention == "unidirectional":
            head_layout.copy_(torch.tril(head_layout))


class LocalSlidingWindowSparsityConfig(SparsityConfig):
    """A sliding window only (no global or random blocks); causal by default."""

    def __init__(self, num_heads: int, block: int = 16, num_sliding_window_blocks: int = 3,
                 attention: str = "unidirectional"):
        super().__init__(num_heads, block)
        _check_attention(attention)
        self.num_sliding_window_blocks = num_sliding_window_blocks
        self.attention = attention

    def fill_head(self, head_layout: torch.Tensor, head: int) -> None:
        _sliding_window(head_layout, self.num_sliding_window_blocks, unidirectional=self.attention == "unidirectional")
