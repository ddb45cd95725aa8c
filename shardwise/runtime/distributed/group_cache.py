"""Process groups built once per layout and shared by every engine of the process.

Each engine needs a dozen process groups (the mesh's data and control groups by purpose,
the world's control group), and a gloo group holds three threads until torch destroys it.
A program that builds and destroys many engines in the same processes (a notebook, a
hyper-parameter sweep, DeepSpeed's own unit tests, whose workers outlive each test) would
otherwise add a dozen groups and some 36 threads per engine, for as long as the process
lives. Groups cannot simply be destroyed with their engine: the model keeps running on
them after `destroy()` (a tensor-parallel layer's collectives, a DTensor's mesh).

So the groups of a layout are built the first time an engine asks for them and handed to
every later engine that asks for the same key, as DeepSpeed keeps its groups in one module
for the whole job. Sharing is safe because every rank issues its collectives on a group in
program order, whichever engine issues them. Creating a group is collective, so every rank
must ask for the same keys in the same order; they do, since they build the same engines.

The groups belong to the default process group: when it is destroyed (which destroys every
group) and the job joined again, the next request finds a different default group and
builds afresh.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import torch.distributed as dist

T = TypeVar("T")

_built: dict[Hashable, Any] = {}
_built_under: list[dist.ProcessGroup | None] = [None]  # the default group `_built` belongs to


def shared_groups(key: Hashable, build: Callable[[], T]) -> T:
    """What `build()` returned for `key` under the current default process group, built
    now if this is the first request (collective: every rank asks in the same order)."""
    world = dist.group.WORLD if dist.is_initialized() else None
    if _built_under[0] is not world:
        _built.clear()
        _built_under[0] = world
    if key not in _built:
        _built[key] = build()  # stored only once every group of the key exists
    return _built[key]
