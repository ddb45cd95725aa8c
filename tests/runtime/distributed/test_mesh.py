"""The parallel layout: sizes from the config, rank order, groups by purpose (docs/formulas.md#notation: with a
mesh, N in the ZeRO formulas is the size of the group ZeRO shards over)."""

import pytest

from shardwise.frontends.deepspeed.config import load_config
from shardwise.frontends.deepspeed.config.policies import policies_from_config
from shardwise.runtime.distributed.mesh import ParallelSizes
from shardwise.runtime.engine.job import parallel_sizes


def sizes_for(world: int, **config) -> ParallelSizes:
    return parallel_sizes(policies_from_config(load_config({"train_batch_size": 8 * world, **config}, world_size=world)),
                          world)


def test_plain_zero_shards_over_every_data_parallel_rank():
    sizes = sizes_for(4, zero_optimization={"stage": 2})
    assert (sizes.data_replicate, sizes.data_shard) == (1, 4)
    assert sizes.groups("shard") == [[0, 1, 2, 3]]
    assert sizes.groups("replicate") == [[0], [1], [2], [3]]


def test_stage_0_is_a_shard_group_of_one_rank_replicated_everywhere():
    sizes = sizes_for(4, zero_optimization={"stage": 0})
    assert (sizes.data_replicate, sizes.data_shard) == (4, 1)
    assert sizes.groups("replicate") == [[0, 1, 2, 3]]
    assert sizes.groups("replicas") == [[0, 1, 2, 3]]


def test_hybrid_sharding_keeps_shard_groups_on_consecutive_ranks():
    sizes = sizes_for(8, zero_optimization={"stage": 3, "mics_shard_size": 4})
    assert sizes.groups("shard") == [[0, 1, 2, 3], [4, 5, 6, 7]]  # one node each
    assert sizes.groups("replicate") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert sizes.groups("data") == [list(range(8))]
    assert sizes.coordinates(6) == {"pipeline": 0, "data_replicate": 1, "data_shard": 2, "sequence": 0, "tensor": 0}


def test_expert_groups_in_deepspeeds_two_orders():
    """E + D (the default) and D + E (`use_data_before_expert_parallelism`), as DeepSpeed
    0.19.8 builds them (deepspeed/utils/groups.py `_create_expert_and_data_parallel`: per
    pipeline stage of `pp_stride` ranks, expert-data groups `range(start + i, start +
    pp_stride, E)` and expert groups of E consecutive ranks; with the flag, expert-data
    groups `range(start + i·s, start + (i + 1)·s)` and expert groups `range(start + i,
    start + pp_stride, s)`, s = pp_stride / E)."""
    plain, swapped = sizes_for(8), sizes_for(8, use_data_before_expert_parallelism=True)
    assert plain.expert_groups(2) == {"expert": [[0, 1], [2, 3], [4, 5], [6, 7]],
                                      "expert_data": [[0, 2, 4, 6], [1, 3, 5, 7]]}
    assert swapped.expert_groups(2) == {"expert": [[0, 4], [1, 5], [2, 6], [3, 7]],
                                        "expert_data": [[0, 1, 2, 3], [4, 5, 6, 7]]}
    assert swapped.expert_groups(4) == {"expert": [[0, 2, 4, 6], [1, 3, 5, 7]],
                                        "expert_data": [[0, 1], [2, 3], [4, 5], [6, 7]]}
    staged = sizes_for(8, use_data_before_expert_parallelism=True, pipeline_parallel={"size": 2})
    assert staged.expert_groups(2) == {"expert": [[0, 2], [1, 3], [4, 6], [5, 7]],
                                       "expert_data": [[0, 1], [2, 3], [4, 5], [6, 7]]}
    with pytest.raises(ValueError, match="NotImplementedError"):
        sizes_for(8, use_data_before_expert_parallelism=True, tensor_parallel={"size": 2}).expert_groups(2)


def test_tensor_is_innermost_and_pipeline_outermost():
    sizes = ParallelSizes(pipeline=2, data_replicate=1, data_shard=2, sequence=1, tensor=2)
    assert sizes.world == 8
    assert sizes.groups("tensor") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert sizes.groups("pipeline") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert sizes.groups("shard") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    for purpose in ("tensor", "pipeline", "shard", "replicas", "data"):
        members = sorted(rank for group in sizes.groups(purpose) for rank in group)
        assert members == list(range(8)), purpose  # every rank in exactly one group


@pytest.mark.parametrize(
    ("world", "zero", "message"),
    [
        (4, {"stage": 2, "mics_shard_size": 3},
         "zero_optimization.mics_shard_size 3 does not divide the data-parallel size 4"),
        (4, {"stage": 0, "mics_shard_size": 2},
         "zero_optimization.mics_shard_size 2 needs zero_optimization.stage 1, 2 or 3"),
    ],
)
def test_shard_sizes_that_do_not_fit_are_refused(world, zero, message):
    from shardwise.frontends.deepspeed.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        load_config({"train_batch_size": 8, "zero_optimization": zero}, world_size=world)


def test_model_parallel_sizes_that_do_not_divide_the_world_are_refused():
    from shardwise.frontends.deepspeed.config import ConfigError

    with pytest.raises(ConfigError) as caught:
        load_config({"train_batch_size": 8, "tensor_parallel": {"size": 3}}, world_size=4)
    assert ("world size 4 is not divisible by tensor_parallel.size 3 * sequence_parallel.size 1 * "
            "pipeline_parallel.size 1 = 3: the data-parallel size must be a whole number") in caught.value.problems
