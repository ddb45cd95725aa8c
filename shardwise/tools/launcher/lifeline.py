"""Workers that die with their launcher, even when it is killed with SIGKILL.

torchrun starts each worker in a session of its own (so a Ctrl-C at the terminal reaches
only the launcher, which forwards it), which also means nothing stops the workers when
the launcher dies without running its handlers: they would keep training, orphaned.
Linux can tie a process's life to its parent's: `prctl(PR_SET_PDEATHSIG, SIGKILL)` makes
the kernel send SIGKILL when the parent *thread* exits. torchrun's agent starts the
workers with `subprocess.Popen` from the thread that then waits for them, and `numactl`
(its GPU binding) execs in place, so that thread is the launcher's own and lives exactly
as long as the job.

The launcher puts its pid in the workers' environment (`launcher_environment`); each
worker calls `die_with_launcher` first thing. The death signal only covers a parent that
exits after it is set, so the worker then checks that its launcher is still there.
Elsewhere than Linux there is no such call, and workers are left as torchrun leaves them.

`kill_workers` is the launcher's side of a second Ctrl-C: it does not wait for workers
still finishing their step, and kills its children at once (Linux: found through /proc).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from pathlib import Path

LAUNCHER_PID_ENV = "SHARDWISE_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def launcher_environment() -> dict[str, str]:
    """What a launcher adds to its workers' environment: its pid, for `die_with_launcher`."""
    return {LAUNCHER_PID_ENV: str(os.getpid())}


def die_with_launcher() -> None:
    """Have the kernel SIGKILL this process when its launcher exits; if it already has,
    die now.

    A no-op outside Linux or when no launcher set `SHARDWISE_LAUNCHER_PID`. The variable
    is removed, so processes this one starts (data loader workers, a nested launcher)
    do not mistake that launcher for theirs.
    """
    text = os.environ.pop(LAUNCHER_PID_ENV, None)
    if text is None or not sys.platform.startswith("linux"):
        return
    launcher = int(text)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(code)}")
    # The launcher died before the call above if this process was handed to another
    # parent. A parent other than the launcher while the launcher lives means something
    # (a PYTHON_EXEC wrapper) runs in between; its death, not the launcher's, is what
    # the kernel will report then.
    if os.getppid() != launcher and not _alive(launcher):
        os.kill(os.getpid(), signal.SIGKILL)


def kill_workers() -> None:
    """SIGKILL every child of this process, i.e. the workers torchrun's agent started in
    it; a no-op outside Linux, where the agent's own shutdown has to do."""
    if not sys.platform.startswith("linux"):
        return
    for pid in _children():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # exited meanwhile


def _children() -> list[int]:
    """Processes whose parent is this one, from each process's /proc/PID/stat."""
    me = os.getpid()
    children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # exited meanwhile
            continue
        # "PID (COMMAND) STATE PPID ...": the command may hold spaces and parentheses.
        if int(stat.rpartition(")")[2].split()[1]) == me:
            children.append(int(entry.name))
    return children


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True
