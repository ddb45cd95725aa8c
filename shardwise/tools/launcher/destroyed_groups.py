"""Process groups a script destroys stay referenced until the script's objects are gone.

A deadlock of torch (seen with 2.13 on gloo: 4 of 15 runs of an Accelerate DDP script on a
loaded machine, 2 of 9 under plain torchrun; every thread's stack taken with py-spy):
a collective issued during backward keeps a copy of the thread-local state, which holds a
Python object (torch's `_engine_run_backward` stashes the `contextvars` context there), so
whoever drops the last reference to that work needs the GIL. gloo's worker thread drops its
reference after marking the work finished, and can be descheduled in between. A script that
destroys its process group (Accelerate's `end_training`) and then frees its DDP model leaves
DDP's C++ Reducer as the group's last owner: freeing the model frees the group with the GIL
held (pybind11 frees it without releasing the GIL), and the group's destructor joins gloo's
worker thread, which waits for the GIL. The process never exits.

So `shardwise run` keeps a Python reference to every group the script destroys until the
script has returned, then drops them: torch's binding releases the GIL while a group it
owns is destroyed, and gloo's threads finish. Nothing else changes: the script's
collectives and results are the same.
"""

from __future__ import annotations

import gc
from typing import Any, Callable

_kept: list[Any] = []
_destroy: Callable[..., None] | None = None


def keep_destroyed_groups() -> None:
    """Make `torch.distributed.destroy_process_group` keep a reference to what it destroys
    (call once torch is imported)."""
    global _destroy
    import torch.distributed as dist

    if _destroy is not None or not dist.is_available():
        return
    _destroy = dist.destroy_process_group

    def destroy_process_group(group=None):  # torch's signature: (group=None)
        if dist.is_initialized():
            _kept.append(dist.group.WORLD if group is None else group)
        _destroy(group)

    dist.destroy_process_group = destroy_process_group


def release_destroyed_groups() -> None:
    """The script has returned: put torch's function back and free the kept groups."""
    global _destroy
    if _destroy is None:
        return
    import torch.distributed as dist

    dist.destroy_process_group = _destroy  # later destructions (exit handlers) keep nothing
    _destroy = None
    gc.collect()  # the script's DDP model, should a reference cycle still hold it
    _kept.clear()
