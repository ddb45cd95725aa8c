"""Finished collectives whose tensors Python dropped at once are kept here, so that gloo's
worker threads never hold the last reference to them.

Why: a gloo collective runs on one of the process group's `pt_gloo_runloop` threads,
which marks it finished (waking the Python caller) and drops its own reference a moment
later. When the caller has already dropped the tensor (a temporary: the loss, a flag, a
norm), that late drop is the last reference, and freeing a tensor Python once held takes
the GIL. If the interpreter has begun to exit by then, CPython ends the thread with
`pthread_exit`, whose unwinding through torch's C++ frames calls `std::terminate`: the
job's work is done, but the process dies with SIGABRT ("terminate called without an
active exception"), about once in 20 runs of a short script on 2 cores.

Keeping the most recent control collectives' works and temporaries here makes the main
thread their last holder: the oldest are released as new ones arrive (long after gloo's
thread is done with them), and `keep_past_exit` leaves the rest to the operating system
when the process exits, so no thread has to free them while the interpreter is
finalizing. The works themselves must be kept, not only their tensors: a work holds the
thread-local state it was issued under, whose Python objects also need the GIL to be
released (measured: keeping the tensors alone still aborts about 1 run in 7). That state
includes the saved-tensor hooks of a checkpointed region, so a work issued inside one
(the stage-3 gather-order checks of a forward) is not kept: it would keep the region's
checkpoints alive; only its tensors are. Data collectives never come here: their
tensors outlive their `wait()` anyway.
"""

from __future__ import annotations

import ctypes
from collections import deque

from shardwise.runtime.base.torch_compat import saved_tensor_hooks_active

_KEPT = 64  # far more collectives than gloo's worker threads (2 per group) can be behind on

_retired: deque[object] = deque(maxlen=_KEPT)


def retire(work: object, *temporaries: object) -> None:
    """Keep a finished control collective's work and temporaries referenced for a while (its
    work only when no saved-tensor hooks are installed, see above)."""
    _retired.append((None if saved_tensor_hooks_active() else work, *temporaries))


def keep_past_exit() -> None:
    """Leave the retired temporaries to the operating system: they are never freed, so no gloo
    thread can be the one to free them while the interpreter finalizes (called at exit)."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(_retired))
