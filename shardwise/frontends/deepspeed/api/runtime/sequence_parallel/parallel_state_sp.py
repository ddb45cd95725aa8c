"""`deepspeed.runtime.sequence_parallel.parallel_state_sp`: the model-parallel unit (mpu)
that `UlyssesSPAttentionHF.register_with_transformers` returns and scripts pass to
`deepspeed.initialize(mpu=...)`.

It holds two groups, built as DeepSpeed 0.19.8 builds them, so a script sees the same
membership under either: the sequence-parallel group of S consecutive ranks
(r // S * S ... + S - 1; the ranks whose attention exchanges positions for heads), and
the sequence-data-parallel group of all data x sequence ranks, which is the whole world
(ZeRO shards and averages over it). Every rank creates every group, in the same order, as
torch.distributed requires. The model-parallel getters answer the sequence group's, as
DeepSpeed's do (its only model-parallel dimension here).

`deepspeed.initialize` accepts this module as its `mpu` (api/init_engine.py): it checks
that the engine's layout puts the same ranks in its `sequence` and `replicas` groups.
"""

from __future__ import annotations

import torch.distributed as dist

from shardwise.runtime.distributed.setup import collective_timeout

_sequence_group: dist.ProcessGroup | None = None
_sequence_data_group: dist.ProcessGroup | None = None


def _release_sequence_parallel_groups() -> None:
    """Forget the groups (after the default group was destroyed), so they can be built again."""
    global _sequence_group, _sequence_data_group
    _sequence_group = _sequence_data_group = None


def initialize_sequence_parallel(sequence_parallel_size: int) -> None:
    """Build the sequence-parallel groups of `sequence_parallel_size` consecutive ranks and
    the sequence-data-parallel group (the world), once per process."""
    global _sequence_group, _sequence_data_group
    assert dist.is_initialized(), "initialize_sequence_parallel needs torch.distributed initialized first"
    world_size = dist.get_world_size()
    if world_size < sequence_parallel_size:
        raise RuntimeError(f"sequence_parallel_size {sequence_parallel_size} is more than the {world_size} ranks "
                           "of the world: each sequence-parallel group needs that many ranks")
    if sequence_parallel_size <= 1:
        raise ValueError(f"sequence_parallel_size must be at least 2 to build sequence-parallel groups, got "
                         f"{sequence_parallel_size}")
    if world_size % sequence_parallel_size:
        raise RuntimeError(f"sequence_parallel_size {sequence_parallel_size} does not divide the world size "
                           f"{world_size}: every rank must belong to one sequence-parallel group")
    assert _sequence_group is None, "the sequence-parallel groups are already initialized in this process"
    rank = dist.get_rank()
    for first in range(0, world_size, sequence_parallel_size):
        ranks = list(range(first, first + sequence_parallel_size))
        group = dist.new_group(ranks, timeout=collective_timeout())
        if rank in ranks:
            _sequence_group = group
    _sequence_data_group = dist.new_group(list(range(world_size)), timeout=collective_timeout())


def get_sequence_parallel_group() -> dist.ProcessGroup:
    assert _sequence_group is not None, "the sequence-parallel group is not initialized"
    return _sequence_group


def get_sequence_data_parallel_group() -> dist.ProcessGroup:
    assert _sequence_data_group is not None, "the sequence-data-parallel group is not initialized"
    return _sequence_data_group


def get_sequence_parallel_world_size() -> int:
    return dist.get_world_size(group=get_sequence_parallel_group())


def get_sequence_data_parallel_world_size() -> int:
    return dist.get_world_size(group=get_sequence_data_parallel_group())


def get_sequence_parallel_rank() -> int:
    return dist.get_rank(group=get_sequence_parallel_group())


def get_sequence_data_parallel_rank() -> int:
    return dist.get_rank(group=get_sequence_data_parallel_group())


def sequence_parallel_ranks() -> list[int]:
    """The global ranks of this rank's sequence-parallel group (deepspeed.initialize checks
    the engine's layout against them)."""
    return dist.get_process_group_ranks(get_sequence_parallel_group())


def sequence_data_parallel_ranks() -> list[int]:
    return dist.get_process_group_ranks(get_sequence_data_parallel_group())


# The only model-parallel dimension of this unit is the sequence one (DeepSpeed's aliases).
get_model_parallel_rank = get_sequence_parallel_rank
get_model_parallel_world_size = get_sequence_parallel_world_size
get_model_parallel_group = get_sequence_parallel_group
