"""Run torchrun's elastic agent in this process, as `shardwise run` and `shardwise train` do.

The agent does what a launcher must (rendezvous, per-worker environment, stopping every
worker when one fails); around it this adds what both commands need: workers that die
with this process (`lifeline`), stop signals that end in `Interrupted` (`interrupts`),
and environment variables for the workers that are set only while they start.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from shardwise.tools.launcher.interrupts import AGENT_SIGNALS, STOP_SIGNALS, agent_signals
from shardwise.tools.launcher.lifeline import launcher_environment
from shardwise.runtime.base.torch_compat import torchrun_leaves_signals, torchrun_signal_options


def run_agent(
    torchrun_options: list[str], entrypoint: str, entrypoint_args: list[str], environment: dict[str, str]
) -> None:
    """Run `entrypoint` (a script path, or a module name when `torchrun_options` hold
    `--module`) with `entrypoint_args` on the workers torchrun's options describe, until
    every worker has exited.

    The arguments are attached after torchrun has parsed its options, because torchrun's
    parser would misread options of theirs that abbreviate its own (`--nproc` is taken
    for `--nproc-per-node`). Raises torchrun's ChildFailedError when a worker fails, and
    `Interrupted` when this process got a stop signal (the workers were sent it too and
    have exited, or been killed after torchrun's shutdown timeout).
    """
    from torch.distributed.run import parse_args, run

    config = parse_args([*torchrun_options, *torchrun_signal_options(AGENT_SIGNALS), entrypoint])
    config.training_script_args = list(entrypoint_args)
    with agent_signals(), torchrun_leaves_signals(STOP_SIGNALS):
        with _environment({**environment, **launcher_environment()}):
            run(config)


@contextmanager
def _environment(variables: dict[str, str]) -> Iterator[None]:
    """Set variables the workers inherit (torchrun copies this process's environment into
    theirs), and restore ours afterwards."""
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
