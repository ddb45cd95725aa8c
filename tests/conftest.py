"""Suite-wide pytest setup.

Belongs here: hooks and fixtures that test folders share. A fixture used by one folder goes
in that folder's own conftest.py; helpers for multi-rank tests live in `shardwise.tools.testing`
(`run_distributed`), not here.
"""

import os

import pytest
import torch.distributed as dist

# Variables through which a launcher tells a process it is one rank of a job. Inherited
# from a shell that ran under torchrun, they would make single-process tests try to join a
# job that does not exist. `run_distributed` sets its own for each rank it starts.
LAUNCHER_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
)
# scripts/test.py's workers take files in this order of their folders (others, the
# documentation site's builds and the README's example among them, first)
_ORDER = {"faults": 0, "frontends": 1, "tools": 2, "benchmarks": 3, "gpu": 4, "formulas": 5, "runtime": 6}
WORKER_PORTS_FROM = 29510  # above torchrun's and DeepSpeed's 29500, below the ephemeral ports


def pytest_configure(config):
    for name in LAUNCHER_VARIABLES:
        os.environ.pop(name, None)
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # "gw0", "gw1", ... under scripts/test.py's workers
    if worker:
        # A test that joins a one-process job in the pytest process (DeepSpeed's
        # `init_distributed` with no launcher) listens on MASTER_PORT, 29500 by default:
        # two workers doing so at once would collide, so each worker has a port of its own.
        os.environ["MASTER_PORT"] = str(WORKER_PORTS_FROM + int(worker.removeprefix("gw")))
    config.addinivalue_line("markers", "slow: extra variants of a capability whose equivalence test runs by "
                                       "default (more stages, Inductor); run with -m slow or SHARDWISE_SLOW_TESTS=1")


def pytest_collection_modifyitems(config, items):
    """`slow` tests are skipped unless asked for. Every capability keeps an equivalence
    test that runs by default; `slow` marks only further variants of it.

    The folders whose files take longest (real processes, timeouts, whole scripts, the
    site's builds) run first, so scripts/test.py's workers end on the many short files and
    finish together."""
    items.sort(key=lambda item: _ORDER.get(item.nodeid.split("/")[1], 0))
    if os.environ.get("SHARDWISE_SLOW_TESTS") == "1" or "slow" in (config.option.markexpr or ""):
        return
    skip = pytest.mark.skip(reason="slow: run with -m slow or SHARDWISE_SLOW_TESTS=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_job_left_behind():
    """A test that joins a job in the pytest process itself (DeepSpeed's `init_distributed`
    with no launcher sets RANK, WORLD_SIZE and MASTER_PORT, as DeepSpeed does, and starts a
    one-process group) leaves neither behind: a later test, or a subprocess it starts,
    would otherwise join that job or find its port taken."""
    before = {name: os.environ.get(name) for name in LAUNCHER_VARIABLES}
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
