"""Owned ranges in global coordinates: a local block's elements as runs of global indices."""

import torch

from shardwise.runtime.zero.shard_view import global_runs


def gathered(global_shape, offsets, local_shape, start, stop):
    """Global flat indices of local elements [start, stop), from the runs."""
    indices = []
    for first, last, _ in global_runs(global_shape, offsets, local_shape, start, stop):
        indices.extend(range(first, last))
    return indices


def reference(global_shape, offsets, local_shape, start, stop):
    full = torch.arange(torch.Size(global_shape).numel()).reshape(global_shape)
    block = full[tuple(slice(o, o + n) for o, n in zip(offsets, local_shape))]
    return block.reshape(-1)[start:stop].tolist()


def test_a_whole_tensor_is_one_run():
    assert global_runs((4, 6), (0, 0), (4, 6), 3, 20) == [(3, 20, 0)]


def test_row_and_column_blocks_match_slicing():
    cases = [
        ((8, 6), (4, 0), (4, 6), 0, 24),  # rows 4-7: contiguous
        ((8, 6), (4, 0), (4, 6), 5, 17),
        ((8, 6), (0, 3), (8, 3), 0, 24),  # columns 3-5: one run per row
        ((8, 6), (0, 3), (8, 3), 4, 11),
        ((2, 4, 6), (1, 0, 2), (1, 4, 2), 1, 7),
    ]
    for case in cases:
        assert gathered(*case) == reference(*case), case
    runs = global_runs((8, 6), (0, 3), (8, 3), 4, 11)
    assert [local for _, _, local in runs] == [0, 2, 5]  # where each run starts in the local range
