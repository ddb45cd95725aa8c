"""`shardwise run`: start one process per device on this node, or join a multi-node job.

torchrun's elastic agent already does what a launcher must (rendezvous, per-worker
environment, log prefixes, stopping every worker when one fails), so this command only
translates a small, checked set of flags into torchrun arguments and runs the agent in
this process (`agent.run_agent`). Each worker runs the script through
`shardwise.tools.launcher.child`, which ties the worker's life to this process's before the
script starts. Interrupted by SIGINT, SIGTERM or SIGHUP, the command stops the workers
and says so in one line. torch is imported only when a job starts, so `shardwise --help`
stays fast.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from typing import Any
from contextlib import contextmanager

from shardwise.tools.launcher.agent import run_agent
from shardwise.tools.launcher.hang_watch import HangWatch, no_progress_seconds
from shardwise.tools.launcher.hosts import (
    DEFAULT_MASTER_PORT, add_hostfile_options, plan_hosts, refuse_hostfile_options, run_on_hosts,
)
from shardwise.tools.launcher.interrupts import Interrupted, interruptible, raise_deferred_stop

CHILD_MODULE = "shardwise.tools.launcher.child"
DEFAULT_CPU_PROCESSES = 2
LOOPBACK = "127.0.0.1"

EXAMPLES = """\
examples:
  shardwise run train.py --lr 3e-4                 one node, free port, one process per GPU
  shardwise run --nproc 4 train.py                 one node, 4 processes
  shardwise run --nnodes 2 --rdzv-endpoint node0:29400 --rdzv-id job1 train.py
                                                   run the same line on both nodes
  shardwise run --nnodes 2 --node-rank 1 --rdzv-endpoint node0:29400 train.py
                                                   fixed node ranks; node 0 hosts the rendezvous
  shardwise run --as-deepspeed --nproc 2 train.py --deepspeed_config ds.json
                                                   an unmodified DeepSpeed script
  shardwise run --hostfile hosts --master_addr node0 train.py
                                                   every host of a DeepSpeed hostfile, over ssh
  shardwise run --hostfile hosts --launcher slurm train.py
                                                   DeepSpeed's srun line, inside an allocation
Everything after the script is passed to it, options included (a `--` directly after the
script is taken by the parser, as argparse does)."""


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "run",
        help="launch a training script on local processes or across nodes (torchrun underneath)",
        description="Start one process per device on this node, or join a multi-node job, "
        "through torch.distributed.run (torchrun).",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        # Without this, a script option such as `--n` is rejected as an ambiguous
        # abbreviation of ours instead of being passed to the script.
        allow_abbrev=False,
    )
    parser.add_argument(
        "--nproc",
        type=_positive_int,
        default=None,
        metavar="N",
        help=f"processes on this node (default: one per CUDA device, or {DEFAULT_CPU_PROCESSES} without CUDA)",
    )
    parser.add_argument(
        "--nnodes",
        type=_node_count,
        default=None,
        metavar="N|MIN:MAX",
        help="number of nodes, or an elastic range (default: 1)",
    )
    parser.add_argument(
        "--node-rank",
        type=_non_negative_int,
        default=None,
        metavar="R",
        help="this node's rank; fixes node ranks (node 0 hosts the rendezvous at --rdzv-endpoint) "
        "instead of assigning them in order of arrival",
    )
    parser.add_argument(
        "--rdzv-endpoint",
        type=_endpoint,
        default=None,
        metavar="HOST:PORT",
        help="where the nodes meet, the same on every node (required when --nnodes > 1)",
    )
    parser.add_argument(
        "--rdzv-id",
        default="shardwise",
        metavar="ID",
        help="job id shared by the nodes of one job (default: shardwise)",
    )
    parser.add_argument(
        "--max-restarts",
        "--max_restarts",
        type=_non_negative_int,
        default=0,
        metavar="N",
        help="restart the workers up to N times when one fails (torchrun's elastic restarts); with "
        "--nnodes MIN:MAX the restart goes on with the nodes still there. Pair it with the config's "
        "auto_resume.checkpoint_dir so each restart continues from the newest checkpoint (default: 0)",
    )
    parser.add_argument(
        "--rdzv-conf",
        default=None,
        metavar="KEY=VALUE,...",
        help="torchrun's rendezvous settings for --rdzv-endpoint, e.g. last_call_timeout=5 (how long a "
        "restart waits for more than MIN nodes, default 30 s)",
    )
    parser.add_argument(
        "--master-port",
        "--master_port",
        type=_port,
        default=None,
        metavar="P",
        help="single node: listen on this port instead of a free one the OS picks; with --hostfile: "
        f"node 0's rendezvous port (default {DEFAULT_MASTER_PORT})",
    )
    parser.add_argument(
        "--as-deepspeed",
        action="store_true",
        help="run an unmodified DeepSpeed script: `import deepspeed` gets shardwise's compatibility package "
        "(shardwise.frontends.deepspeed.api) in this run only, and the script gets --local_rank=<r> as DeepSpeed's "
        "launcher passes it",
    )
    parser.add_argument(
        "--no-local-rank",
        action="store_true",
        help="with --as-deepspeed: do not pass --local_rank to the script (DeepSpeed's --no_local_rank)",
    )
    parser.add_argument(
        "--hang-timeout",
        type=_positive_float,
        default=None,
        metavar="SECONDS",
        help="when a rank has issued no collective and finished none for SECONDS (counted from its first), "
        "print every rank's Python stack and last collectives, name the rank that is behind, and stop the job "
        "(default: SHARDWISE_HANG_TIMEOUT, else off; a failed collective reports the same way regardless)",
    )
    add_hostfile_options(parser)
    parser.add_argument("script", help="the Python script every process runs")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    parser.set_defaults(handler=main)
    return parser


def build_torchrun_args(args: argparse.Namespace) -> list[str]:
    """torchrun's options and script path for parsed `shardwise run` arguments.

    The script's own arguments are not included: `run_agent` attaches them after
    torchrun has parsed its options.

    One node without an endpoint uses torchrun's standalone rendezvous (a store on a free
    port, no race); `--master-port` pins that port instead. Several nodes meet through the
    c10d rendezvous at `--rdzv-endpoint`, or through the static one when `--node-rank`
    fixes which node is which. Raises ValueError for flag combinations that cannot work.
    """
    if args.nproc is None:
        raise ValueError("--nproc is unresolved: call resolve_nproc first")
    nnodes = args.nnodes or "1"
    min_nodes, max_nodes = _parse_node_count(nnodes)
    torchrun_args = ["--nproc-per-node", str(args.nproc), "--nnodes", nnodes]
    if args.max_restarts:
        torchrun_args += ["--max-restarts", str(args.max_restarts)]
    if args.rdzv_conf is not None:
        if args.rdzv_endpoint is None or args.node_rank is not None:
            raise ValueError("--rdzv-conf configures the c10d rendezvous of --rdzv-endpoint (without --node-rank)")
        torchrun_args += ["--rdzv-conf", args.rdzv_conf]

    if args.master_port is not None:
        if max_nodes > 1 or args.rdzv_endpoint is not None or args.node_rank is not None:
            raise ValueError(
                "--master-port is for a single node; nodes of a multi-node job meet at --rdzv-endpoint HOST:PORT"
            )
        torchrun_args += ["--master-addr", LOOPBACK, "--master-port", str(args.master_port)]
    elif args.rdzv_endpoint is None:
        if max_nodes > 1 or args.node_rank is not None:
            raise ValueError(
                f"--nnodes {nnodes}{_node_rank_text(args)} needs --rdzv-endpoint HOST:PORT, "
                "an address of one of the nodes, given identically on every node"
            )
        torchrun_args += ["--standalone"]
    elif args.node_rank is not None:
        if min_nodes != max_nodes:
            raise ValueError(f"--node-rank needs a fixed --nnodes, got {nnodes}")
        if args.node_rank >= max_nodes:
            raise ValueError(f"--node-rank {args.node_rank} is out of range for --nnodes {nnodes}")
        torchrun_args += [
            "--rdzv-backend", "static",
            "--rdzv-endpoint", args.rdzv_endpoint,
            "--node-rank", str(args.node_rank),
        ]  # fmt: skip
    else:
        torchrun_args += [
            "--rdzv-backend", "c10d",
            "--rdzv-endpoint", args.rdzv_endpoint,
            "--rdzv-id", args.rdzv_id,
        ]  # fmt: skip
    return [*torchrun_args, args.script]


def resolve_nproc(args: argparse.Namespace) -> argparse.Namespace:
    """Fill in the default process count, which needs torch to count CUDA devices."""
    if args.nproc is None:
        import torch

        args.nproc = torch.cuda.device_count() if torch.cuda.is_available() else DEFAULT_CPU_PROCESSES
    return args


def main(args: argparse.Namespace) -> int:
    with interruptible():
        try:
            raise_deferred_stop()
            return _launch(args)
        except Interrupted as stop:
            print(f"shardwise run: {stop}; stopped every worker of {args.script}", file=sys.stderr)
            return stop.exit_code


def _launch(args: argparse.Namespace) -> int:
    if not os.path.isfile(args.script):
        print(f"shardwise run: error: no such script: {args.script}", file=sys.stderr)
        return 2
    try:
        if args.hostfile is not None:
            hosts_job = plan_hosts(args)
            if hosts_job is not None:
                return run_on_hosts(args, hosts_job)
        else:
            refuse_hostfile_options(args)
        *torchrun_options, script = build_torchrun_args(resolve_nproc(args))
        hang_seconds = no_progress_seconds(args.hang_timeout)
    except ValueError as error:
        print(f"shardwise run: error: {error}", file=sys.stderr)
        return 2

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    watch = HangWatch(no_progress_seconds=hang_seconds)
    try:
        with watch, _script_environment(args) as (environment, first_args):
            environment = {**environment, **watch.environment()}
            if args.max_restarts:
                environment = {**environment, **_restartable_store()}
            if args.visible_devices is not None:  # the slots of a hostfile's one selected host
                environment = {**environment, "CUDA_VISIBLE_DEVICES": args.visible_devices}
            run_agent([*torchrun_options, "--module"], CHILD_MODULE, [script, *first_args, *args.script_args],
                      environment)
    except ChildFailedError as error:
        if not watch.stopped_job:  # else the workers only died of the watch's SIGTERM
            print(first_failure(error.failures), file=sys.stderr)
            # Named after the script, not the module every worker starts it through.
            print(ChildFailedError(name=script, failures=error.failures).format_msg(), file=sys.stderr)
        if watch.summary is not None:  # last, where it is seen: the rank that is behind
            print(watch.summary, file=sys.stderr)
        return 1
    if watch.summary is not None:  # the script caught its failed collective and went on
        print(watch.summary, file=sys.stderr)
    return 0


def _restartable_store() -> dict[str, str]:
    """Workers that meet again after an elastic restart.

    By default torchrun's workers share the rendezvous store of the agents and tell their
    rounds apart by a key prefix made of TORCHELASTIC_RESTART_COUNT. That count is each
    agent's own: an agent restarted because a peer failed counts one restart, one that
    restarts for the changed membership counts none, so after a lost node the survivors
    can look for each other under different prefixes and never meet (or find the dead
    round's addresses). torch's TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 gives every round a
    fresh store on the new rank 0 instead; a value the user set is kept."""
    return {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")}


def first_failure(failures: dict) -> str:
    """One line before torchrun's report (tens of lines per rank): the rank that failed
    first and why, from its error file (launcher/child.py writes it), its signal or its
    exit status; ranks that failed after it (often only because it did) are counted.
    Failure times are whole seconds: within one second, a rank stopped by SIGTERM (what
    torchrun sends the others once one fails) comes after a rank that failed of itself."""
    rank, failure = min(failures.items(), key=lambda item: (item[1].timestamp, _stopped_by_sigterm(item[1]), item[0]))
    if failure.error_file_data:
        cause = str(failure.message).splitlines()[0] if str(failure.message).strip() else "an exception"
    elif failure.exitcode < 0:
        cause = f"killed by {failure.signal_name()}"
    else:
        cause = f"exit status {failure.exitcode}"
    later = sorted(set(failures) - {rank})
    after = f" (rank(s) {', '.join(map(str, later))} failed too)" if later else ""
    return f"shardwise run: rank {rank} failed first: {cause}{after}"


def _stopped_by_sigterm(failure: Any) -> bool:
    """Killed by SIGTERM, or its error file says it received one (torch's SignalException)."""
    if failure.exitcode < 0:
        return failure.signal_name() == "SIGTERM"
    return "(SIGTERM)" in str(failure.message)


@contextmanager
def _script_environment(args: argparse.Namespace) -> Iterator[tuple[dict[str, str], list[str]]]:
    """Variables for the workers and arguments to put before the script's own: none,
    or with --as-deepspeed the `deepspeed` alias and DeepSpeed's `--local_rank=<r>`
    (torchrun replaces `${local_rank}` with each worker's)."""
    if not args.as_deepspeed:
        yield {}, []
        return
    from shardwise.frontends.deepspeed.alias import as_deepspeed_environment

    with as_deepspeed_environment() as environment:
        yield environment, [] if args.no_local_rank else ["--local_rank=${local_rank}"]


def _node_rank_text(args: argparse.Namespace) -> str:
    return "" if args.node_rank is None else f" with --node-rank {args.node_rank}"


def _parse_node_count(text: str) -> tuple[int, int]:
    parts = text.split(":")
    if len(parts) > 2 or not all(part.isdigit() for part in parts):
        raise ValueError(f"expected N or MIN:MAX with positive integers, got {text!r}")
    min_nodes, max_nodes = int(parts[0]), int(parts[-1])
    if not 1 <= min_nodes <= max_nodes:
        raise ValueError(f"expected 1 <= MIN <= MAX, got {text!r}")
    return min_nodes, max_nodes


def _node_count(text: str) -> str:
    try:
        _parse_node_count(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error
    return text


def _positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return value


def _port(text: str) -> int:
    value = _int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port in 1..65535, got {text!r}")
    return value


def _endpoint(text: str) -> str:
    host, _, port = text.rpartition(":")
    if not host:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    _port(port)
    return text


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
