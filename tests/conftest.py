"""Suite-wide pytest setup.

Belongs here: hooks and fixtures that test folders share. A fixture used by one folder goes
in that folder's own conftest.py; helpers for multi-rank tests live in `shardwise.testing`
(`run_distributed`), not here.
"""

import os

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


def pytest_configure(config):
    for name in LAUNCHER_VARIABLES:
        os.environ.pop(name, None)
