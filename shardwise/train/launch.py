"""Start the ranks of a `shardwise train` job through torchrun, as `shardwise run` does.

torchrun's agent already does what the job needs from a parent: a rendezvous on a free
port, per-rank environment, and stopping every rank when one fails or on Ctrl-C. The
ranks run `python -m shardwise.train.worker <options.json>`; they inherit this
terminal, so rank 0 can draw the live progress bar.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from shardwise.launcher.cli import build_torchrun_args

WORKER_MODULE = "shardwise.train.worker"


def threads_per_rank(nproc: int) -> int:
    """CPU threads each rank may use: the cores shared out, so ranks do not oversubscribe them."""
    return max(1, (os.cpu_count() or 1) // nproc)


def launch_ranks(options_path: Path, nproc: int, threads: int) -> int:
    """Run the worker on `nproc` local ranks; 0 when every rank succeeded, else 1."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    single_node = argparse.Namespace(
        nproc=nproc, nnodes="1", node_rank=None, rdzv_endpoint=None, rdzv_id="shardwise-train",
        master_port=None, script=WORKER_MODULE,
    )
    *torchrun_options, module = build_torchrun_args(single_node)
    torchrun_config = parse_args([*torchrun_options, "--module", module])
    torchrun_config.training_script_args = [os.fspath(options_path)]
    try:
        with _environment(OMP_NUM_THREADS=str(threads)):
            run(torchrun_config)
    except ChildFailedError as error:
        print(error.format_msg(), file=sys.stderr)
        return 1
    return 0


@contextmanager
def _environment(**variables: str) -> Iterator[None]:
    """Set variables the ranks inherit, and restore ours afterwards. OMP_NUM_THREADS set
    here also stops torchrun from overriding it with 1 (and warning about it)."""
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
