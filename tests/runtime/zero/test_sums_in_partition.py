"""Stages 2-3 in a shard group of one (zero/gradients.py `_sums_in_partitions`): autograd
sums every micro-batch straight into the store's gradient partition, with no bucket, and
training gives the very bits the bucket path gives, parameters unused in some
micro-batches included."""

import pytest
import torch

import shardwise
from shardwise.runtime.zero.gradients import GradientReducer
from shardwise.tools.testing import run_distributed
from tests.runtime.zero.test_unused_parameters import PartlyUsed, config
from tests.runtime.zero.workers import Case, assert_matches_reference, train_parallel, train_reference


def _through(buckets: bool, train, *arguments) -> dict:
    """`train(*arguments)` with the partitions summed in (`buckets` False) or bucketed as in
    a larger group; notes how many units summed in their partition and how many buckets
    were made."""
    summing, made = GradientReducer._sums_in_partitions, []
    allocate = GradientReducer._bucket_for

    def counting(self, unit):
        before = self._bucket_count
        bucket = allocate(self, unit)
        made.append(self._bucket_count - before)
        return bucket

    def noting(self):
        units = summing(self) if not buckets else {}
        made.append(-len(units))  # (negative: units summing in place)
        return units

    GradientReducer._sums_in_partitions, GradientReducer._bucket_for = noting, counting
    try:
        result = train(*arguments)
    finally:
        GradientReducer._sums_in_partitions, GradientReducer._bucket_for = summing, allocate
    return {**result, "in_place_units": -sum(n for n in made if n < 0), "buckets": sum(n for n in made if n > 0)}


def train_through(rank: int, world_size: int, case: Case, buckets: bool) -> dict:
    return _through(buckets, train_parallel, rank, world_size, case)


@pytest.mark.parametrize(("stage", "dtype"), [(2, "fp32"), (3, "fp32"), (3, "bf16"), (3, "fp16")])
def test_a_group_of_one_sums_in_its_partition_bit_for_bit_like_the_buckets(stage, dtype):
    case = Case(stage=stage, dtype=dtype, accumulation=3, lr=1e-2 if dtype == "fp32" else 1e-3)
    [summed] = run_distributed(train_through, 1, case, False)
    [bucketed] = run_distributed(train_through, 1, case, True)
    assert summed["in_place_units"] == summed["units"] and summed["buckets"] == 0
    assert bucketed["in_place_units"] == 0 and bucketed["buckets"] > 0
    assert summed["losses"] == bucketed["losses"]
    for name, tensor in bucketed["params"].items():
        assert torch.equal(summed["params"][name], tensor), name
    # the ledger counts no bucket: the largest unit's bucket and its spare are gone
    bucket_bytes = bucketed["largest_unit"] * (4 if dtype == "fp32" else 2)
    assert bucketed["memory"]["buffers"] - summed["memory"]["buffers"] >= bucket_bytes
    reference = train_reference(Case(accumulation=3, lr=case.lr), 1)
    if dtype != "fp16":  # fp16 skips steps while its loss scale settles: its check is the bits against buckets
        assert_matches_reference(summed, reference, 1e-5 if dtype == "fp32" else 2e-2)


def train_partly_used(rank: int, world_size: int, stage: int, buckets: bool) -> dict:
    def train() -> dict:
        engine = shardwise.initialize(PartlyUsed(), config(stage, ignore=True, offload=False))
        losses = []
        for uses_spare in ([False, True], [True, False], [False, False], [True, True]):
            for micro, use_spare in enumerate(uses_spare):
                loss = engine(torch.full((2, 4), 0.5 + micro), use_spare)
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
        with shardwise.gathered_parameters(list(engine.module.parameters())):
            params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        engine.destroy()
        return {"losses": losses, "params": params}

    return _through(buckets, train)


@pytest.mark.parametrize("stage", [2, 3])
def test_a_parameter_unused_in_some_micro_batches_adds_nothing_to_its_partition(stage):
    [summed] = run_distributed(train_partly_used, 1, stage, False)
    [bucketed] = run_distributed(train_partly_used, 1, stage, True)
    assert summed["in_place_units"] > 0 and summed["buckets"] == 0
    assert summed["losses"] == bucketed["losses"]
    for name, tensor in bucketed["params"].items():
        assert torch.equal(summed["params"][name], tensor), name
    assert not torch.equal(summed["params"]["spare.weight"], PartlyUsed().spare.weight.detach())  # it trained
