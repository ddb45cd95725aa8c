"""`python -m shardwise.tools.launcher.child SCRIPT [ARGS...]`: how `shardwise run` starts the
user's script in every worker.

The script runs unmodified and sees what `python SCRIPT ARGS...` would show it:
`sys.argv` is `[SCRIPT, *ARGS]`, `sys.path[0]` the script's directory, `__name__`
"__main__", and an exception it raises is printed from the script's frames down, exit
status 1, and its one-line summary goes to torchrun's error file for the worker, which
the launcher reads to name the failing rank and its exception. Before it starts, the worker is tied to the launcher's life
(`die_with_launcher`), which a plain `python` cannot do, and takes part in the
launcher's hang watch (`watch_this_worker`); process groups the script destroys stay
referenced until it has returned (`destroyed_groups`: a torch deadlock at exit). A KeyboardInterrupt the script
lets through (the launcher forwards a Ctrl-C as SIGINT) ends the worker quietly with
status 130, as shells report it, and without running exit handlers: the launcher prints
the one line about the interrupt.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys
import time
from types import TracebackType

from shardwise.tools.launcher.destroyed_groups import keep_destroyed_groups, release_destroyed_groups
from shardwise.tools.launcher.lifeline import die_with_launcher
from shardwise.tools.launcher.torch_import import after_torch_import
from shardwise.tools.launcher.worker_watch import watch_this_worker

INTERRUPTED = 128 + signal.SIGINT  # the status a shell reports for a Ctrl-C
USAGE = "usage: python -m shardwise.tools.launcher.child SCRIPT [ARGS...]"


def main() -> None:
    die_with_launcher()
    watch_this_worker()
    if len(sys.argv) < 2:
        print(USAGE, file=sys.stderr)
        sys.exit(2)
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.realpath(script))
    after_torch_import(keep_destroyed_groups)
    try:
        try:
            runpy.run_path(script, run_name="__main__")
        finally:
            release_destroyed_groups()
    except KeyboardInterrupt:
        _exit_quietly(INTERRUPTED)
    except Exception as error:
        try:
            error.__traceback__ = _from_script(error.__traceback__, script)
            sys.excepthook(type(error), error, error.__traceback__)
            _record_for_the_launcher(error)
        except KeyboardInterrupt:
            # A Ctrl-C was pending when the script failed: the failure is its echo (a
            # collective whose peer the same Ctrl-C already ended), not news.
            _exit_quietly(INTERRUPTED)
        sys.exit(1)


def _record_for_the_launcher(error: Exception) -> None:
    """Write `ExceptionType: message` where torchrun's agent reads a worker's failure
    (TORCHELASTIC_ERROR_FILE, the format its `@record` writes with a plain message); the
    traceback itself is already on stderr."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        with open(path, "w") as handle:
            json.dump({"message": f"{type(error).__name__}: {error}", "timestamp": str(int(time.time()))}, handle)


def _exit_quietly(status: int) -> None:
    """Exit without interpreter finalization: a process group whose collective was cut
    short by the interrupt aborts the process when finalization destroys it ("terminate
    called without an active exception"), which is noise after a Ctrl-C."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(status)


def _from_script(traceback: TracebackType | None, script: str) -> TracebackType | None:
    """The traceback without this module's and runpy's frames above the script's; None
    when the script never ran (a syntax error, which carries its own location)."""
    while traceback is not None and traceback.tb_frame.f_code.co_filename != script:
        traceback = traceback.tb_next
    return traceback


if __name__ == "__main__":
    main()
