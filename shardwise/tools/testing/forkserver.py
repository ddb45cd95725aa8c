"""A multiprocessing context whose processes start with torch (and friends) already imported.

The test suite starts hundreds of short multi-rank runs on a 2-core machine. With `spawn`
every rank pays for importing torch (~1.3 s) and transformers (~2.6 s); with `fork` every
rank inherits whatever state the pytest process has accumulated (initialised process
groups, seeds, threads). A fork server imports the heavy modules once, in a clean process,
and forks each rank from there: fast and clean.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from multiprocessing.context import ForkServerContext

# Third-party modules the fork server imports once. A missing optional package is skipped
# by multiprocessing itself (it ignores ImportError while preloading).
HEAVY_MODULES = (
    "torch",
    "torch.distributed",
    "pytest",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "transformers.models.gpt2.modeling_gpt2",
)

_warmed_up_by_pid: int | None = None


def preloaded_forkserver_context() -> ForkServerContext:
    """The process-wide fork-server context, its server started and done preloading.

    The first call starts the server and waits for the preload by running one no-op
    process; later calls return at once. Waiting here rather than inside the first rank's
    start keeps the seconds-long preload out of the window in which an interrupt could
    leave a started rank whose pid the caller never learned.
    """
    global _warmed_up_by_pid
    context = multiprocessing.get_context("forkserver")
    if _warmed_up_by_pid != os.getpid():
        context.set_forkserver_preload(modules_to_preload())
        warm_up = context.Process(target=os.getpid, name="forkserver-warm-up")
        warm_up.start()
        warm_up.join()
        warm_up.close()
        _warmed_up_by_pid = os.getpid()
    return context


def modules_to_preload() -> list[str]:
    """`HEAVY_MODULES` and every shardwise module this process has imported so far.

    By the first multi-rank test pytest has collected every test module, so this covers
    what a rank imports when it unpickles its test function; and these modules are known
    to import cleanly (a preload error other than ImportError would kill the fork server).
    """
    shardwise_modules = sorted(name for name in sys.modules if name.split(".")[0] == "shardwise")
    return [*HEAVY_MODULES, *shardwise_modules]
