"""Layouts equal DeepSpeed's `make_layout` for the same parameters (C20).

Two independent checks: small layouts computed by hand from DeepSpeed's documentation,
and a loop-by-loop re-derivation of its algorithm (deepspeed_layouts.py) over many
parameter sets, random layouts included under a fixed seed.
"""

import random

import pytest
import torch

from shardwise.runtime.ops.sparse_attention import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    VariableSparsityConfig,
)
from tests.runtime.ops import deepspeed_layouts as ds


def _grid(rows: str) -> torch.Tensor:
    return torch.tensor([[int(c) for c in row] for row in rows.split()], dtype=torch.int64)


HAND_COMPUTED = [
    # Fixed, 6 blocks, windows of 4: window [0,4) and the short [4,6); the window's last block (3)
    # is global, and the short window's global block is shifted to fit (5).
    (FixedSparsityConfig(1, block=2), 12, "111101 111101 111101 111101 000111 000111"),
    (FixedSparsityConfig(1, block=2, attention="unidirectional"), 12,
     "100000 110000 111000 111100 000110 000111"),
    (FixedSparsityConfig(1, block=2, horizontal_global_attention=True), 12,
     "111101 111101 111101 111111 000111 111111"),
    # BSLongformer: a 3-block sliding window, block 0 global both ways.
    (BSLongformerSparsityConfig(1, block=1), 5, "11111 11100 11110 10111 10011"),
    # BigBird without random blocks, causal: window, block 0 global, then the lower triangle.
    (BigBirdSparsityConfig(1, block=1, num_random_blocks=0, attention="unidirectional"), 4,
     "1000 1100 1110 1011"),
    # Variable: windows of 1 then 2 (repeating), block 2 global to every row.
    (VariableSparsityConfig(1, block=1, local_window_blocks=[1, 2], global_block_indices=[2]), 5,
     "10100 01100 01100 00111 00111"),
    (LocalSlidingWindowSparsityConfig(1, block=1), 4, "1000 1100 0110 0011"),
    (DenseSparsityConfig(1, block=4), 8, "11 11"),
]


@pytest.mark.parametrize("config, seq_len, expected", HAND_COMPUTED)
def test_small_layouts_computed_by_hand(config, seq_len, expected):
    assert torch.equal(config.make_layout(seq_len)[0], _grid(expected))


CASES = [
    (lambda: FixedSparsityConfig(4, block=1, num_local_blocks=4, num_global_blocks=2), lambda: ds.fixed(4, 23, local=4, global_=2)),
    (lambda: FixedSparsityConfig(4, block=1, different_layout_per_head=True, num_local_blocks=6, num_global_blocks=2,
                                 num_different_global_patterns=3, attention="unidirectional"),
     lambda: ds.fixed(4, 23, per_head=True, local=6, global_=2, patterns=3, attention="unidirectional")),
    (lambda: FixedSparsityConfig(3, block=1, different_layout_per_head=True, num_local_blocks=4, num_different_global_patterns=4,
                                 horizontal_global_attention=True),
     lambda: ds.fixed(3, 23, per_head=True, local=4, patterns=4, horizontal=True)),
    (lambda: VariableSparsityConfig(2, block=1, num_random_blocks=2, local_window_blocks=[2, 5, 3],
                                    global_block_indices=[1, 9], global_block_end_indices=[3, 12],
                                    horizontal_global_attention=True),
     lambda: ds.variable(2, 23, random_blocks=2, windows=[2, 5, 3], global_starts=[1, 9], global_ends=[3, 12],
                         horizontal=True)),
    (lambda: VariableSparsityConfig(3, block=1, different_layout_per_head=True, num_random_blocks=1,
                                    global_block_indices=[0, 7, 40], attention="unidirectional"),
     lambda: ds.variable(3, 23, per_head=True, random_blocks=1, global_starts=[0, 7, 40], attention="unidirectional")),
    (lambda: BigBirdSparsityConfig(4, block=1, different_layout_per_head=True, num_random_blocks=3,
                                   num_sliding_window_blocks=5, num_global_blocks=2),
     lambda: ds.bigbird(4, 23, per_head=True, random_blocks=3, window=5, global_=2)),
    (lambda: BigBirdSparsityConfig(2, block=1, attention="unidirectional"),
     lambda: ds.bigbird(2, 23, attention="unidirectional")),
    # a global index past the last block is skipped, as DeepSpeed's `idx < num_blocks` does
    (lambda: BSLongformerSparsityConfig(2, block=1, num_sliding_window_blocks=5, global_block_indices=[3, 30]),
     lambda: ds.bslongformer(2, 23, window=5, global_starts=[3, 30])),
    (lambda: VariableSparsityConfig(2, block=1), lambda: ds.variable(2, 23)),
    (lambda: LocalSlidingWindowSparsityConfig(2, block=1, num_sliding_window_blocks=5),
     lambda: ds.local_sliding(2, 23, window=5)),
    (lambda: LocalSlidingWindowSparsityConfig(2, block=1, num_sliding_window_blocks=4, attention="bidirectional"),
     lambda: ds.local_sliding(2, 23, window=4, attention="bidirectional")),
    (lambda: BSLongformerSparsityConfig(2, block=1, num_sliding_window_blocks=7, global_block_indices=[0, 10],
                                        global_block_end_indices=[2, 30], attention="unidirectional"),
     lambda: ds.bslongformer(2, 23, window=7, global_starts=[0, 10], global_ends=[2, 30], attention="unidirectional")),
]


@pytest.mark.parametrize("make, expected", CASES)
def test_layouts_equal_deepspeeds_algorithm_random_blocks_under_a_fixed_seed(make, expected):
    random.seed(7)
    layout = make().make_layout(23)
    random.seed(7)
    assert torch.equal(layout, expected())
    assert layout.dtype == torch.int64 and layout.shape[1:] == (23, 23)


def test_the_layout_is_over_blocks_of_the_sequence():
    """block 16 at 368 tokens: the 23 x 23 layout of block 1 at 23 tokens."""
    random.seed(3)
    layout = BigBirdSparsityConfig(2, block=16, num_random_blocks=2).make_layout(368)
    random.seed(3)
    assert torch.equal(layout, ds.bigbird(2, 23, random_blocks=2))


def test_random_layouts_change_with_the_seed_and_repeat_with_it():
    config = BigBirdSparsityConfig(2, block=1, num_random_blocks=2)
    layouts = []
    for seed in (1, 2, 1):
        random.seed(seed)
        layouts.append(config.make_layout(32))
    assert torch.equal(layouts[0], layouts[2]) and not torch.equal(layouts[0], layouts[1])


@pytest.mark.parametrize("make, message", [
    (lambda: FixedSparsityConfig(1, num_local_blocks=4, num_global_blocks=3), "not divisible"),
    (lambda: FixedSparsityConfig(1, attention="unidirectional", horizontal_global_attention=True), "bidirectional"),
    (lambda: FixedSparsityConfig(2, num_different_global_patterns=2), "different_layout_per_head"),
    (lambda: FixedSparsityConfig(2, different_layout_per_head=True, num_different_global_patterns=5), "4 / 1"),
    (lambda: VariableSparsityConfig(1, global_block_indices=[0, 4], global_block_end_indices=[2]), "one end index"),
    (lambda: BSLongformerSparsityConfig(1, global_block_indices=[3], global_block_end_indices=[3]), "empty"),
    (lambda: BigBirdSparsityConfig(1, attention="causal"), "not an attention type"),
    (lambda: BigBirdSparsityConfig(1, block=4).make_layout(10), "not a multiple"),
    (lambda: BigBirdSparsityConfig(1, block=1, num_sliding_window_blocks=5).make_layout(4), "smaller window"),
    (lambda: BigBirdSparsityConfig(1, block=1, num_random_blocks=2, attention="unidirectional").make_layout(8),
     "num_random_blocks <= 1"),
])
def test_bad_parameters_are_refused_with_the_reason(make, message):
    with pytest.raises(ValueError, match=message):
        make()
