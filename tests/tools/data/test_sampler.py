"""The block sampler: the same global batch at every world size, disjoint rows per rank."""

import numpy as np
import pytest
import torch

from shardwise.tools.data import BlockSampler

TOKENS = (np.arange(50_000) % 251).astype(np.uint8)


def global_batch(sampler: BlockSampler, step: int, world_size: int, accumulation: int = 1) -> torch.Tensor:
    """Every rank's micro-batches, concatenated in rank order."""
    rows = []
    for rank in range(world_size):
        for x, _ in sampler.micro_batches(step, rank, world_size, accumulation):
            rows.append(x)
    return torch.cat(rows)


@pytest.mark.parametrize("world_size,accumulation", [(2, 1), (2, 2), (4, 1)])
def test_global_batch_is_the_same_at_every_world_size(world_size, accumulation):
    sampler = BlockSampler(TOKENS, seq_len=16, global_batch=8, seed=3)
    for step in (0, 7):
        reference = global_batch(sampler, step, world_size=1)
        assert reference.shape == (8, 16)
        assert torch.equal(global_batch(sampler, step, world_size, accumulation), reference)


def test_ranks_get_disjoint_rows_that_cover_the_batch():
    sampler = BlockSampler(TOKENS, seq_len=16, global_batch=8, seed=3)
    slices = [sampler.rank_rows(rank, 2) for rank in range(2)]
    assert [(s.start, s.stop) for s in slices] == [(0, 4), (4, 8)]
    offsets = sampler.global_offsets(0)
    rank0, rank1 = (set(offsets[s].tolist()) for s in slices)
    assert rank0.isdisjoint(rank1)
    (x0, _), (x1, _) = sampler.micro_batches(0, 0, 2)[0], sampler.micro_batches(0, 1, 2)[0]
    assert not torch.equal(x0, x1)


def test_targets_are_inputs_shifted_by_one():
    sampler = BlockSampler(TOKENS, seq_len=16, global_batch=4, seed=0)
    (x, y), = sampler.micro_batches(5, 0, 1)
    assert x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    offsets = sampler.global_offsets(5)
    assert torch.equal(x[0], torch.from_numpy(TOKENS[offsets[0] : offsets[0] + 16].astype(np.int64)))


def test_rows_depend_on_seed_and_step_only():
    a = BlockSampler(TOKENS, seq_len=16, global_batch=4, seed=1)
    b = BlockSampler(TOKENS, seq_len=16, global_batch=4, seed=1)
    assert np.array_equal(a.global_offsets(3), b.global_offsets(3))
    assert not np.array_equal(a.global_offsets(3), a.global_offsets(4))
    assert not np.array_equal(a.global_offsets(3), BlockSampler(TOKENS, 16, 4, seed=2).global_offsets(3))


def test_uneven_splits_are_refused_with_the_numbers():
    sampler = BlockSampler(TOKENS, seq_len=16, global_batch=6, seed=0)
    with pytest.raises(ValueError, match="global batch 6 is not divisible by world size 4"):
        sampler.micro_batches(0, 0, 4)
    with pytest.raises(ValueError, match="3 rows per rank .* do not split into 2 micro-batches"):
        sampler.micro_batches(0, 0, 2, accumulation_steps=2)
    with pytest.raises(ValueError, match="too few for blocks"):
        BlockSampler(TOKENS[:10], seq_len=16, global_batch=2, seed=0)
