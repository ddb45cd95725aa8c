"""torch.distributed's collectives, noted in the flight recorder (flight_recorder.py).

A plain torch script under `shardwise run` never goes through a `Communicator`, so its
collectives are seen where it calls them: `record_torch_collectives` replaces each
collective function of `torch.distributed` (and of `distributed_c10d`, where torch's own
modules look them up) by a wrapper that notes the call, its group, the size of its first
tensor argument and, for a blocking call, its end. The launcher installs it as
torch.distributed is imported (tools/launcher/worker_watch.py), before the script can
bind the names with `from torch.distributed import all_reduce`.

A call inside another recorded one (torch's `all_gather_object` calls `all_gather`; a
Communicator calls these functions) is not noted again, so every rank counts the same
calls.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from shardwise.runtime.distributed.flight_recorder import RECORDER

COLLECTIVES = (
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter", "barrier",
    "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
)  # fmt: skip
_WRAPPED = "__shardwise_recorded__"


def record_torch_collectives() -> None:
    """Wrap torch.distributed's collectives once per process (later calls do nothing)."""
    for name in COLLECTIVES:
        original = getattr(distributed_c10d, name, None)
        if original is None or getattr(original, _WRAPPED, False):
            continue
        wrapper = _recorded(name, original)
        setattr(distributed_c10d, name, wrapper)
        if getattr(dist, name, None) is original:
            setattr(dist, name, wrapper)


def _recorded(name: str, original: Callable) -> Callable:
    parameters = list(inspect.signature(original).parameters)
    group_at = parameters.index("group") if "group" in parameters else None
    async_at = parameters.index("async_op") if "async_op" in parameters else None

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        if RECORDER.nested():
            return original(*args, **kwargs)
        group = _argument(args, kwargs, "group", group_at)
        asynchronous = bool(_argument(args, kwargs, "async_op", async_at))
        label, ranks = _group(group)
        record = RECORDER.issue(label, ranks, name, "", _first_tensor_bytes(args), asynchronous=asynchronous)
        RECORDER.enter()
        try:
            result = original(*args, **kwargs)
        except Exception:
            RECORDER.fail(record)
            raise
        finally:
            RECORDER.leave()
        if not asynchronous:
            RECORDER.finish(record)
        return result

    setattr(wrapper, _WRAPPED, True)
    return wrapper


def _argument(args: tuple, kwargs: dict, name: str, position: int | None):
    if name in kwargs:
        return kwargs[name]
    return args[position] if position is not None and position < len(args) else None


_NAMES: dict[tuple[str, int], tuple[str, tuple[int, ...]]] = {}  # by name and identity: holding a group
# itself would keep it past destroy_process_group, into interpreter teardown, where gloo can abort


def _group(group: dist.ProcessGroup | None) -> tuple[str, tuple[int, ...]]:
    """A name the same on every member, and the members' global ranks."""
    try:
        group = group if group is not None else dist.group.WORLD
        key = (group.group_name, id(group))  # a name is reused by a group made after a destroy
        named = _NAMES.get(key)
        if named is None:
            ranks = tuple(dist.get_process_group_ranks(group))
            consecutive = ranks == tuple(range(ranks[0], ranks[-1] + 1))
            members = f"ranks {ranks[0]}-{ranks[-1]}" if consecutive else f"ranks {list(ranks)}"
            named = ("world" if group is dist.group.WORLD else f"group of {members}", ranks)
            _NAMES[key] = named
        return named
    except Exception:  # not initialized yet, or a group this rank is not in: the call itself will say
        return "world", ()


def _first_tensor_bytes(args: tuple) -> int:
    for value in args:
        if isinstance(value, torch.Tensor):
            return value.numel() * value.element_size()
        if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
            return sum(tensor.numel() * tensor.element_size() for tensor in value)
    return 0
