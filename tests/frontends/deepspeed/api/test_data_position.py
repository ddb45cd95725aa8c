"""Exact resume including the data (C34): the checkpoint holds the position of the loader
`deepspeed.initialize(training_data=...)` built, so a run stopped at an optimizer step and
resumed reads what the uninterrupted run read next: at the same data-parallel size the
same batches, so the same losses step by step; at another size (the same global batch)
the same samples in every step, none repeated and none skipped."""

import pytest
import torch
from torch.utils.data import DistributedSampler

from shardwise.frontends.deepspeed.data_loader import PositionedSampler
from shardwise.tools.testing import run_distributed
from tests.frontends.deepspeed.api.data_position_workers import IndexedRows, train

STEPS, STOP = 8, 3  # 5 steps per epoch: the resumed run finishes epoch 0 and starts epoch 1


def samples_per_step(runs: list[list[dict]]) -> dict[int, list[int]]:
    """Every rank's sample indices, by optimizer step, sorted."""
    steps: dict[int, list[int]] = {}
    for records in runs:
        for record in records:
            steps.setdefault(record["step"], []).extend(record["indices"])
    return {step: sorted(indices) for step, indices in sorted(steps.items())}


def relative_error(a: list[float], b: list[float]) -> float:
    a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return ((a - b).abs() / b.abs().clamp_min(1e-12)).max().item()


@pytest.mark.parametrize("set_epoch", [True, False])
def test_a_resumed_run_equals_the_uninterrupted_one_step_for_step(tmp_path, set_epoch):
    whole = run_distributed(train, 2, str(tmp_path / "unused"), steps=STEPS, set_epoch=set_epoch)
    first = run_distributed(train, 2, str(tmp_path / "run"), steps=STEPS, stop_at=STOP, set_epoch=set_epoch)
    rest = run_distributed(train, 2, str(tmp_path / "run"), steps=STEPS, resume=True, set_epoch=set_epoch)
    for rank in range(2):
        resumed = first[rank] + rest[rank]
        assert [r["indices"] for r in resumed] == [r["indices"] for r in whole[rank]]
        assert [r["step"] for r in resumed] == [r["step"] for r in whole[rank]]
        assert relative_error([r["loss"] for r in resumed], [r["loss"] for r in whole[rank]]) < 1e-6


def test_an_automatic_resume_puts_the_loader_back_too(tmp_path):
    """auto_resume loads the checkpoint while the engine is built, before
    deepspeed.initialize builds its loader: the loader still starts where the checkpoint was."""
    whole = run_distributed(train, 2, str(tmp_path / "unused"), steps=STEPS)
    first = run_distributed(train, 2, str(tmp_path / "run"), steps=STEPS, stop_at=STOP, auto_resume=True)
    rest = run_distributed(train, 2, str(tmp_path / "run"), steps=STEPS, auto_resume=True)
    for rank in range(2):
        assert [r["indices"] for r in first[rank] + rest[rank]] == [r["indices"] for r in whole[rank]]


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2)])
def test_a_run_resumed_at_another_size_reads_every_sample_once(tmp_path, before, after):
    whole = run_distributed(train, before, str(tmp_path / "unused"), steps=STEPS)
    first = run_distributed(train, before, str(tmp_path / "run"), steps=STEPS, stop_at=STOP)
    rest = run_distributed(train, after, str(tmp_path / "run"), steps=STEPS, resume=True)
    resumed = samples_per_step(first + rest)
    assert resumed == samples_per_step(whole)
    epoch_zero = [index for step in range(5) for index in resumed[step]]
    assert sorted(epoch_zero) == list(range(len(IndexedRows())))  # every sample once, none twice


@pytest.mark.parametrize("drop_last", [True, False])
def test_the_sampler_reads_what_deepspeeds_does(drop_last):
    data = IndexedRows()
    for replicas in (1, 2, 3):
        for rank in range(replicas):
            theirs = DistributedSampler(data, num_replicas=replicas, rank=rank, drop_last=drop_last)
            ours = PositionedSampler(data, num_replicas=replicas, rank=rank, drop_last=drop_last)
            for epoch in (0, 1):
                theirs.set_epoch(epoch)
                ours.set_epoch(epoch)
                assert list(ours) == list(theirs)


def test_a_position_the_new_size_cannot_split_is_refused():
    from shardwise.frontends.deepspeed.data_loader import DeepSpeedDataLoader

    data = IndexedRows()
    loader = DeepSpeedDataLoader(data, batch_size=2, sampler=PositionedSampler(data, num_replicas=3, rank=0,
                                                                               drop_last=False),
                                 collate_fn=None, drop_last=False)
    with pytest.raises(ValueError, match="does not split evenly over 3 data-parallel ranks"):
        loader.load_state_dict({"epoch": 0, "consumed": 8, "seed": 0, "shuffle": True, "samples": 40})
    with pytest.raises(ValueError, match="dataset of 41 samples"):
        loader.load_state_dict({"epoch": 0, "consumed": 6, "seed": 0, "shuffle": True, "samples": 41})


def batches_of(loader, count: int) -> list[list[int]]:
    iterator = iter(loader)
    return [next(iterator)[2].tolist() for _ in range(count)]


def single_rank_loader():
    from shardwise.frontends.deepspeed.data_loader import DeepSpeedDataLoader

    data = IndexedRows()
    sampler = PositionedSampler(data, num_replicas=1, rank=0, drop_last=False)
    return DeepSpeedDataLoader(data, batch_size=8, sampler=sampler, collate_fn=None, drop_last=False)


@pytest.mark.parametrize("read", [3, 5, 7])
def test_a_repeating_loader_built_before_the_load_resumes_where_the_saved_one_stood(read):
    """RepeatingLoader (DeepSpeed's, which pipeline scripts and train_batch use) calls
    iter() when built; the position applies to that pass all the same. 5 batches make an
    epoch: read 5 is a finished pass (the next starts the order again), read 7 is inside
    the second pass."""
    from shardwise.frontends.deepspeed.api.utils import RepeatingLoader

    original = single_rank_loader()
    expected = batches_of(RepeatingLoader(original), read + 4)
    saved = single_rank_loader()
    repeating = RepeatingLoader(saved)
    for _ in range(read):
        next(repeating)
    state = saved.state_dict()
    assert state["consumed"] == (read % 5) * 8
    fresh = single_rank_loader()
    resumed = RepeatingLoader(fresh)
    fresh.load_state_dict(state)
    assert [next(resumed)[2].tolist() for _ in range(4)] == expected[read:]
