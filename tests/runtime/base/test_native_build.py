"""The C libraries built on first use (shardwise/runtime/base/native_build.py): every
thread that asks for one while it is being built gets it, and it is built once."""

import threading
import time

from shardwise.runtime.base.native_build import CompiledLibrary


def test_threads_asking_while_the_library_loads_all_get_it_loaded_once():
    """Ranks run as threads (tests/runtime/optim/pieces.py) ask for the kernels at once on
    their first step: a thread that came while the first was loading used to get None
    and step on the torch path beside threads on the kernels."""
    loads, library = [], object()

    def load():
        loads.append(threading.get_ident())
        time.sleep(0.2)  # a build takes about a second
        return library

    compiled = CompiledLibrary(load, what="a test library", fallback="nothing.")
    got, start = [], threading.Barrier(4)

    def ask():
        start.wait()
        got.append(compiled.get())

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert got == [library] * 4 and len(loads) == 1
    assert compiled.get() is library and len(loads) == 1


def test_a_library_that_cannot_be_built_is_warned_about_once_and_gives_none(recwarn):
    def load():
        raise RuntimeError("no C compiler found")

    compiled = CompiledLibrary(load, what="a test library", fallback="the torch path runs.")
    assert compiled.get() is None and compiled.get() is None
    assert [str(warning.message) for warning in recwarn.list] == [
        "shardwise: a test library could not be built (no C compiler found); the torch path runs. Install a C "
        "compiler (cc) to use them."]
