"""`deepspeed.utils.groups`: the getters scripts call for the data-, model-, sequence- and
expert-parallel groups, answered from the layout of the last engine `deepspeed.initialize`
built (its `ParallelMesh`), and before any, as DeepSpeed 0.19.8 answers without a model-
parallel unit: the data-parallel group is (a clone of) the whole world, the model- and
sequence-parallel sizes are 1 and their ranks 0, there is no sequence-parallel group
(KeyError; nor after it without sequence parallelism, as in DeepSpeed) and no expert group
(AssertionError) yet.

With a layout, by shardwise's group purposes (runtime/distributed/mesh.py): data-parallel
is `data` (the ranks reading different samples), sequence-parallel `sequence`, sequence-
data-parallel `replicas` (data x sequence, what ZeRO shards over with sequence
parallelism), model-parallel the tensor-parallel size, and the expert groups of an
expert-parallel size E, DeepSpeed's `ep_size_E`, are `expert` and `expert_data`. A group
of one rank has no process group in the mesh; asked for, it is created here once, by
every rank in the same order, as DeepSpeed creates its world clone on first use.

The getters without an underscore (`get_data_parallel_group`, `get_tensor_model_parallel_rank`,
..., the model-parallel unit DeepSpeed's AutoTP builds) answer, as in DeepSpeed, only once
a layout with tensor parallelism exists; before, and without it, they raise DeepSpeed's
AssertionError ("... group is not initialized").

With ALST's mpu (`deepspeed.initialize(mpu=...)`, api/runtime/sequence_parallel/), the
sequence and sequence-data groups are the mpu's own process groups, as in DeepSpeed: the
script's adapter and attention run their collectives on them (initialize checked that
the layout's groups hold the same ranks, so sizes and ranks agree).
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING

import torch.distributed as dist

from shardwise.frontends.deepspeed.api.utils.exceptions import DeprecatedException
from shardwise.runtime.distributed.setup import collective_timeout

if TYPE_CHECKING:
    from shardwise.runtime.distributed.mesh import GroupHandle, ParallelMesh


_mesh: ParallelMesh | None = None
_sequence_groups: ModuleType | None = None  # ALST's mpu (parallel_state_sp), when initialize was given it
_created: dict[tuple[tuple[int, ...], ...], dist.ProcessGroup] = {}  # groups of one rank, by their layout
_tensor_size_set: int | None = None  # set_tensor_model_parallel_world_size / _rank, which win over the layout
_tensor_rank_set: int | None = None


def use_mesh(mesh: ParallelMesh, *, sequence_groups: ModuleType | None = None) -> None:
    """The layout the getters answer from (`deepspeed.initialize` calls this), and the mpu
    whose process groups are the sequence groups, if it was given one."""
    global _mesh, _sequence_groups
    _mesh, _sequence_groups = mesh, sequence_groups


def _initialized() -> None:
    assert dist.is_initialized(), "dist is not initialized"


def _process_group(handle: GroupHandle, layout: list[list[int]]) -> dist.ProcessGroup:
    if handle.group is not None:
        return handle.group
    key = tuple(tuple(group) for group in layout)
    if key not in _created:
        _created[key], _ = dist.new_subgroups_by_enumeration(ranks_per_subgroup_list=layout,
                                                                     timeout=collective_timeout())
    return _created[key]


def _get_data_parallel_group() -> dist.ProcessGroup:
    _initialized()
    if _mesh is None:
        return _process_group_of_world()
    return _process_group(_mesh["data"], _mesh.sizes.groups("data"))


def _process_group_of_world() -> dist.ProcessGroup:
    """DeepSpeed's clone of the world group (made once)."""
    layout = [list(range(dist.get_world_size()))]
    key = tuple(tuple(group) for group in layout)
    if key not in _created:
        _created[key] = dist.new_group(ranks=layout[0], timeout=collective_timeout())
    return _created[key]


def _get_data_parallel_group_ranks() -> list[int]:
    _initialized()
    return list(_mesh["data"].ranks) if _mesh is not None else list(range(dist.get_world_size()))


def _get_data_parallel_world_size() -> int:
    _initialized()
    return _mesh["data"].size if _mesh is not None else dist.get_world_size()


def _get_data_parallel_rank() -> int:
    _initialized()
    return _mesh["data"].rank if _mesh is not None else dist.get_rank()


def _get_model_parallel_world_size() -> int:
    return _mesh["tensor"].size if _mesh is not None else 1


def _get_sequence_parallel_world_size() -> int:
    _initialized()
    return _mesh["sequence"].size if _mesh is not None else 1


def _get_sequence_parallel_rank() -> int:
    return _mesh["sequence"].rank if _mesh is not None else 0


def _get_sequence_parallel_group() -> dist.ProcessGroup:
    """DeepSpeed has one only when sequence parallelism is on; so here."""
    if _sequence_groups is not None:
        return _sequence_groups.get_sequence_parallel_group()
    if _mesh is None or _mesh["sequence"].size == 1:
        raise KeyError("No sequence parallel group found")
    return _process_group(_mesh["sequence"], _mesh.sizes.groups("sequence"))


def _get_sequence_data_parallel_world_size() -> int:
    return _mesh["replicas"].size if _mesh is not None else _get_data_parallel_world_size()


def _get_sequence_data_parallel_rank() -> int:
    return _mesh["replicas"].rank if _mesh is not None else _get_data_parallel_rank()


def _get_sequence_data_parallel_group() -> dist.ProcessGroup:
    if _sequence_groups is not None:
        return _sequence_groups.get_sequence_data_parallel_group()
    if _mesh is None:
        return _get_data_parallel_group()
    return _process_group(_mesh["replicas"], _mesh.sizes.groups("replicas"))


# -- expert parallelism: DeepSpeed names a size E's groups "ep_size_E" -----------------------
def _expert_sizes() -> list[int]:
    """The expert-parallel sizes whose groups the layout has built (by its MoE layers)."""
    if _mesh is None:
        return []
    return sorted(int(key.removeprefix("expert_")) for key in _mesh.handles
                  if key.startswith("expert_") and not key.startswith("expert_data_"))


def _expert_size(group_name: str) -> int:
    sizes = {f"ep_size_{size}": size for size in _expert_sizes()}
    assert group_name in sizes, "expert parallel group is not initialized"
    return sizes[group_name]


def _expert_handle(group_name: str, purpose: str) -> tuple[GroupHandle, list[list[int]]]:
    size = _expert_size(group_name)
    handles = dict(zip(("expert", "expert_data"), _mesh.expert_handles(size)))
    return handles[purpose], _mesh.sizes.expert_groups(size)[purpose]


def _get_expert_parallel_group(group_name: str) -> dist.ProcessGroup:
    return _process_group(*_expert_handle(group_name, "expert"))


def _get_expert_data_parallel_group(group_name: str) -> dist.ProcessGroup:
    return _process_group(*_expert_handle(group_name, "expert_data"))


def _get_expert_parallel_group_dict() -> dict[str, dist.ProcessGroup]:
    return {f"ep_size_{size}": _get_expert_parallel_group(f"ep_size_{size}") for size in _expert_sizes()}


def _get_expert_data_parallel_group_dict() -> dict[str, dist.ProcessGroup]:
    return {f"ep_size_{size}": _get_expert_data_parallel_group(f"ep_size_{size}") for size in _expert_sizes()}


def _get_expert_parallel_world_size(group_name: str) -> int:
    _initialized()
    return _expert_handle(group_name, "expert")[0].size


def _get_expert_parallel_rank(group_name: str) -> int:
    _initialized()
    return _expert_handle(group_name, "expert")[0].rank


def _get_expert_data_parallel_world_size(group_name: str) -> int:
    _initialized()
    return _expert_handle(group_name, "expert_data")[0].size


def _get_expert_data_parallel_rank(group_name: str) -> int:
    _initialized()
    return _expert_handle(group_name, "expert_data")[0].rank


def _get_max_expert_size() -> int | None:
    sizes = _expert_sizes()
    return max(sizes) if sizes else None


def _get_max_expert_size_name() -> str:
    return f"ep_size_{_get_max_expert_size()}"


# -- the model-parallel unit's getters (DeepSpeed's AutoTP groups) ------------------------------
def initialize(ep_size: int = 1, mpu: object = None) -> None:
    raise DeprecatedException("Please do not use the groups.initialize() API as it is deprecated. Instead, pass the "
                              "desired ep_size to deepspeed.moe.layer.MoE(..,ep_size,..)")


def _ensure_divisibility(numerator: int, denominator: int) -> None:
    assert numerator % denominator == 0, f"{numerator} is not divisible by {denominator}"


def _tensor_parallel_layout() -> bool:
    return _mesh is not None and _mesh["tensor"].size > 1


def get_data_parallel_group() -> dist.ProcessGroup:
    assert _tensor_parallel_layout(), "data parallel group is not initialized"
    return _process_group(_mesh["data"], _mesh.sizes.groups("data"))


def get_tensor_model_parallel_group() -> dist.ProcessGroup:
    assert _tensor_parallel_layout(), "intra_layer_model parallel group is not initialized"
    return _process_group(_mesh["tensor"], _mesh.sizes.groups("tensor"))


def get_model_parallel_group() -> dist.ProcessGroup:
    assert _tensor_parallel_layout(), "model parallel group is not initialized"
    return get_tensor_model_parallel_group()


def set_tensor_model_parallel_world_size(world_size: int) -> None:
    global _tensor_size_set
    _tensor_size_set = world_size


def set_tensor_model_parallel_rank(rank: int) -> None:
    global _tensor_rank_set
    _tensor_rank_set = rank


def get_tensor_model_parallel_world_size() -> int:
    if _tensor_size_set is not None:
        return _tensor_size_set
    return dist.get_world_size(group=get_tensor_model_parallel_group())


def get_tensor_model_parallel_rank() -> int:
    if _tensor_rank_set is not None:
        return _tensor_rank_set
    return dist.get_rank(group=get_tensor_model_parallel_group())


def get_model_parallel_world_size() -> int:
    return get_tensor_model_parallel_world_size()


def get_model_parallel_rank() -> int:
    return get_tensor_model_parallel_rank()


def get_tensor_model_parallel_src_rank() -> int:
    """The global rank of this rank's tensor group's first member (tensor groups are runs
    of consecutive ranks)."""
    size = get_tensor_model_parallel_world_size()
    return dist.get_rank() // size * size


def get_data_parallel_world_size() -> int:
    return dist.get_world_size(group=get_data_parallel_group())


def get_data_parallel_rank() -> int:
    return dist.get_rank(group=get_data_parallel_group())


def _get_broadcast_src_rank() -> int:
    _initialized()
    return dist.get_global_rank(_get_sequence_data_parallel_group(), 0)


def _get_expert_broadcast_src_rank(group_name: str) -> int:
    return dist.get_global_rank(_get_expert_data_parallel_group(group_name), 0)
