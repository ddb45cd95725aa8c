"""Stage 3 in a shard group of one (zero/sole_param_home.py): gathers point the units at
their shards instead of copying them, and training, edits and checkpoints give the very
bits the copying gathers give."""

import pytest
import torch

from shardwise.runtime.zero import shared_param_home
from shardwise.runtime.zero.sole_param_home import SoleParamHome
from shardwise.tools.testing import run_distributed
from tests.runtime.zero.test_shared_param_home import (
    PARTITION_EVERYTHING,
    PER_BLOCK,
    assert_same_bits,
    edit_save_and_load,
)
from tests.runtime.zero.workers import Case, assert_matches_reference, train_parallel, train_reference

COPYING = {shared_param_home.ENABLE_VARIABLE: "0"}


def train_noting_home(rank: int, world_size: int, case: Case) -> dict:
    """`train_parallel`, noting the stage-3 homes built and the gather buffers they filled."""
    from shardwise.runtime.zero import sharded_params
    from shardwise.runtime.zero.gather_buffers import GatherBuffers

    made, homes, units, fills = sharded_params.sole_param_home, [], [], []
    fill = GatherBuffers.fill

    def noting(*arguments, **options):
        home = made(*arguments, **options)
        homes.append(type(home).__name__)
        units.append(len(arguments[0]))
        return home

    def counting(self, *arguments, **options):
        fills.append(1)
        return fill(self, *arguments, **options)

    sharded_params.sole_param_home, GatherBuffers.fill = noting, counting
    try:
        result = train_parallel(rank, world_size, case)
    finally:
        sharded_params.sole_param_home, GatherBuffers.fill = made, fill
    return {**result, "homes": homes, "units": sum(units), "buffer_fills": len(fills)}


@pytest.mark.parametrize(("dtype", "gathering"), [("fp32", "per module"), ("bf16", "per block")])
def test_a_group_of_one_trains_bit_for_bit_like_the_copying_gathers(dtype, gathering):
    extra = {**PARTITION_EVERYTHING, **(PER_BLOCK if gathering == "per block" else {})}
    lr = 1e-2 if dtype == "fp32" else 1e-3
    case = Case(stage=3, dtype=dtype, accumulation=2, lr=lr, extra_config={"zero_optimization": extra})
    [sole] = run_distributed(train_noting_home, 1, case)
    [copying] = run_distributed(train_noting_home, 1, case, env=COPYING)
    assert sole["homes"] == [SoleParamHome.__name__] and copying["homes"] == ["NoneType"]
    # gather buffers only for the final read of the weights (`gathered_parameters` takes a
    # private copy, one per unit); the copying gathers fill one at every gather of the passes
    assert sole["buffer_fills"] == sole["units"] and copying["buffer_fills"] > 4 * copying["units"]
    assert_same_bits(sole, copying)
    assert_matches_reference(sole, train_reference(Case(accumulation=2, lr=lr), 1), 1e-5 if dtype == "fp32" else 2e-2)


def test_edits_and_checkpoints_in_a_group_of_one_give_what_the_copying_gathers_give(tmp_path):
    [sole] = run_distributed(edit_save_and_load, 1, str(tmp_path / "sole"))
    [copying] = run_distributed(edit_save_and_load, 1, str(tmp_path / "copying"), env=COPYING)
    edited = sole["edited"]
    assert torch.equal(edited, copying["edited"])
    assert (edited[0] == 0.5).all() and not (edited == 7.0).any()
    assert sole["losses"] == copying["losses"]
    for mine, theirs, loaded in zip(sole["trained"], copying["trained"], sole["loaded"]):
        assert torch.equal(mine, theirs) and torch.equal(mine, loaded)
    assert sole["next"][0] == sole["next"][1] == copying["next"][0]
