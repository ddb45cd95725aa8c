"""DeepSpeed's `make_layout`, re-derived for the tests from the algorithm its docstrings describe.

Written element by element with plain loops over Python lists, deliberately unlike
shardwise's tensor-slicing implementation, so the two can only agree by both following
DeepSpeed's rules (deepspeed/ops/sparse_attention/sparsity_config.py). Random blocks are
drawn with `random.sample` in DeepSpeed's order: head by head, then row by row, before
any other block of that head is set.
"""

from __future__ import annotations

import random

import torch


def _empty(heads: int, blocks: int) -> list[list[list[int]]]:
    return [[[0] * blocks for _ in range(blocks)] for _ in range(heads)]


def _finish(grid: list[list[list[int]]], heads: int, per_head: bool) -> torch.Tensor:
    if not per_head:
        grid = [grid[0]] * heads
    return torch.tensor(grid, dtype=torch.int64)


def _window(head: list[list[int]], start: int, stop: int, unidirectional: bool) -> None:
    for row in range(start, stop):
        for col in range(start, stop):
            if col <= row or not unidirectional:
                head[row][col] = 1


def _sliding(head: list[list[int]], window: int) -> None:
    blocks = len(head)
    for row in range(blocks):
        for col in range(blocks):
            if abs(col - row) <= window // 2:
                head[row][col] = 1


def _lower_triangle(head: list[list[int]]) -> None:
    for row in range(len(head)):
        for col in range(row + 1, len(head)):
            head[row][col] = 0


def fixed(heads, blocks, per_head=False, local=4, global_=1, attention="bidirectional", horizontal=False,
          patterns=1) -> torch.Tensor:
    grid = _empty(heads, blocks)
    uni = attention == "unidirectional"
    for h in range(heads if per_head else 1):
        head = grid[h]
        for start in range(0, blocks, local):
            _window(head, start, min(start + local, blocks), uni)
        first = local - (1 + h % patterns) * global_
        globals_ = [start for start in range(first, blocks - blocks % local, local)]
        if blocks % local:
            globals_.append(min(blocks - blocks % local + first, blocks - global_))
        for start in globals_:
            for col in range(start, start + global_):
                for row in range(blocks):
                    if not uni or row >= start:
                        head[row][col] = 1
                    if horizontal:
                        head[col][row] = 1
    return _finish(grid, heads, per_head)


def variable(heads, blocks, per_head=False, random_blocks=0, windows=(4,), global_starts=(0,), global_ends=None,
             attention="bidirectional", horizontal=False) -> torch.Tensor:
    grid = _empty(heads, blocks)
    uni = attention == "unidirectional"
    for h in range(heads if per_head else 1):
        head = grid[h]
        for row in range(blocks):
            for col in random.sample(range(blocks), random_blocks):
                head[row][col] = 1
        sizes = list(windows)
        start = 0
        while start < blocks:
            size = sizes.pop(0) if sizes else windows[-1]
            _window(head, start, min(start + size, blocks), uni)
            start += size
        ends = global_ends or [s + 1 for s in global_starts]
        for start, end in zip(global_starts, ends):
            for idx in range(start, min(end, blocks)):
                for other in range(blocks):
                    if horizontal:
                        head[idx][other] = 1
                    if not uni or other >= start:
                        head[other][idx] = 1
    return _finish(grid, heads, per_head)


def bigbird(heads, blocks, per_head=False, random_blocks=1, window=3, global_=1,
            attention="bidirectional") -> torch.Tensor:
    grid = _empty(heads, blocks)
    uni = attention == "unidirectional"
    for h in range(heads if per_head else 1):
        head = grid[h]
        for row in range(blocks):
            for col in random.sample(range(row + 1) if uni else range(blocks), random_blocks):
                head[row][col] = 1
        _sliding(head, window)
        for g in range(global_):
            for other in range(blocks):
                head[g][other] = head[other][g] = 1
        if uni:
            _lower_triangle(head)
    return _finish(grid, heads, per_head)


def bslongformer(heads, blocks, per_head=False, window=3, global_starts=(0,), global_ends=None,
                 attention="bidirectional") -> torch.Tensor:
    grid = _empty(heads, blocks)
    for h in range(heads if per_head else 1):
        head = grid[h]
        _sliding(head, window)
        ends = global_ends or [s + 1 for s in global_starts]
        for start, end in zip(global_starts, ends):
            for idx in range(start, min(end, blocks)):
                for other in range(blocks):
                    head[idx][other] = head[other][idx] = 1
        if attention == "unidirectional":
            _lower_triangle(head)
    return _finish(grid, heads, per_head)


def local_sliding(heads, blocks, window=3, attention="unidirectional") -> torch.Tensor:
    """Each row keeps the blocks within window // 2 of it, only earlier ones if unidirectional."""
    grid = _empty(heads, blocks)
    head = grid[0]
    for row in range(blocks):
        for col in range(blocks):
            if row - window // 2 <= col <= (row if attention == "unidirectional" else row + window // 2):
                head[row][col] = 1
    return _finish(grid, heads, False)
