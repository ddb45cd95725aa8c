"""Start the ranks of a `shardwise train` job through torchrun, as `shardwise run` does.

torchrun's agent already does what the job needs from a parent: a rendezvous on a free
port, per-rank environment, and stopping every rank when one fails. The ranks run
`python -m shardwise.tools.train.worker <options.json>`; they inherit this terminal, so rank 0
can draw the live progress bar. A stop signal reaching this process is forwarded to the
ranks, which finish their step and write a checkpoint (`shardwise.tools.train.stopping`).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from shardwise.tools.launcher.agent import run_agent
from shardwise.tools.launcher.cli import build_torchrun_args
from shardwise.tools.launcher.interrupts import Interrupted
from shardwise.tools.train.stopping import stopped_by

WORKER_MODULE = "shardwise.tools.train.worker"


def threads_per_rank(nproc: int) -> int:
    """CPU threads each rank may use: the cores shared out, so ranks do not oversubscribe them."""
    return max(1, (os.cpu_count() or 1) // nproc)


def launch_ranks(options_path: Path, nproc: int, threads: int) -> int:
    """Run the worker on `nproc` local ranks; 0 when every rank succeeded, else 1.

    Raises `Interrupted` when this process got a stop signal, or when the ranks alone did
    and stopped early because of it.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    single_node = argparse.Namespace(
        nproc=nproc, nnodes="1", node_rank=None, rdzv_endpoint=None, rdzv_id="shardwise-train",
        master_port=None, max_restarts=0, rdzv_conf=None, script=WORKER_MODULE,
    )
    *torchrun_options, module = build_torchrun_args(single_node)
    # OMP_NUM_THREADS set here also stops torchrun from overriding it with 1 (and warning).
    environment = {"OMP_NUM_THREADS": str(threads)}
    try:
        run_agent([*torchrun_options, "--module"], module, [os.fspath(options_path)], environment)
    except ChildFailedError as error:
        signum = stopped_by([failure.exitcode for failure in error.failures.values()])
        if signum:
            raise Interrupted(signum) from None
        print(error.format_msg(), file=sys.stderr)
        return 1
    return 0
