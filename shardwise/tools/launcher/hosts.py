"""`shardwise run`'s DeepSpeed-launcher flags: --hostfile and what selects and starts
its hosts (--include, --exclude, --num_nodes, --num_gpus, --master_addr, --launcher,
--launcher_args, --ssh_port), both spellings (`--num_nodes`, `--num-nodes`) accepted.

As with DeepSpeed's launcher, a selection of one host runs on this machine; several run
through the chosen launcher (`multinode`). The ssh launcher is the default here, where
DeepSpeed's is pdsh: it needs nothing installed beyond ssh, and it stops every host
when one fails.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
from pathlib import Path

from shardwise.tools.launcher.forwarded_environment import forwarded_variables
from shardwise.tools.launcher.hostfile import read_hostfile, select_slots
from shardwise.tools.launcher.multinode import (
    LAUNCHERS, Job, mpirun_command, pdsh_command, require_program, run_all, run_one, ssh_commands, srun_command,
)

DEFAULT_MASTER_PORT = 29500  # DeepSpeed's
HOSTFILE_OPTIONS = ("include", "exclude", "num_nodes", "num_gpus", "master_addr", "launcher", "launcher_args",
                    "ssh_port")


def add_hostfile_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("hosts of a DeepSpeed hostfile (DeepSpeed's launcher flags)")
    group.add_argument("-H", "--hostfile", default=None, metavar="FILE",
                       help="run on the hosts of FILE, one line `HOST slots=N` per host")
    group.add_argument("-i", "--include", default="", metavar="SPEC",
                       help="only these hosts and slots: HOST[:SLOT[,SLOT...]][@HOST...]")
    group.add_argument("-e", "--exclude", default="", metavar="SPEC", help="all but these hosts and slots")
    group.add_argument("--num_nodes", "--num-nodes", type=int, default=-1, metavar="N",
                       help="the first N hosts of the hostfile")
    group.add_argument("--num_gpus", "--num-gpus", "--num_accelerators", type=int, default=-1, metavar="N",
                       help="slots 0..N-1 of every host")
    group.add_argument("--master_addr", "--master-addr", default="", metavar="HOST",
                       help="address of the first host, where the nodes meet (default: its `hostname -I`)")
    group.add_argument("--launcher", choices=LAUNCHERS, default=None,
                       help="how the hosts are started (default: ssh)")
    group.add_argument("--launcher_args", "--launcher-args", default="", metavar="ARGS",
                       help="options for ssh, pdsh, srun or mpirun, as one quoted string")
    group.add_argument("--ssh_port", "--ssh-port", type=int, default=None, metavar="P", help="ssh's port")
    parser.set_defaults(visible_devices=None)


def refuse_hostfile_options(args: argparse.Namespace) -> None:
    """The host-selection flags mean nothing without a hostfile: say so rather than
    ignore them."""
    given = [name for name in HOSTFILE_OPTIONS if getattr(args, name) not in ("", -1, None)]
    if given:
        raise ValueError(f"--{given[0]} selects hosts of a hostfile: add --hostfile FILE, or leave it out "
                         "(on one node, CUDA_VISIBLE_DEVICES=... shardwise run --nproc N)")


def plan_hosts(args: argparse.Namespace) -> Job | None:
    """The job on the selected hosts, or None when one host is selected: then `args` is
    set up for a launch on this machine (its process count and visible devices)."""
    for flag, value in (("--nproc", args.nproc), ("--nnodes", args.nnodes), ("--node-rank", args.node_rank),
                        ("--rdzv-endpoint", args.rdzv_endpoint), ("--rdzv-conf", args.rdzv_conf)):
        if value is not None:
            raise ValueError(f"{flag} comes from the hostfile with --hostfile: leave it out")
    pool = read_hostfile(args.hostfile)
    hosts = select_slots(pool, include=args.include, exclude=args.exclude, num_nodes=args.num_nodes,
                         num_gpus=args.num_gpus)
    launcher = args.launcher or "ssh"
    if launcher == "openmpi" and (args.include or args.exclude or args.num_nodes != -1 or args.num_gpus != -1):
        raise ValueError("--launcher openmpi runs every slot of the hostfile: --include, --exclude, --num_nodes "
                         "and --num_gpus cannot narrow it")
    if launcher == "slurm":
        srun_command(_job(args, hosts, master_addr=""), filtered=False, num_nodes=-1, num_gpus=-1)  # checks hosts
    if len(hosts) == 1:
        (slots,) = hosts.values()
        args.nproc = len(slots)
        args.visible_devices = ",".join(str(slot) for slot in slots)
        return None
    if launcher in ("slurm", "openmpi") and args.as_deepspeed:
        raise ValueError(f"--as-deepspeed needs shardwise's launcher on every node, which --launcher {launcher} "
                         "does not run: use --launcher ssh or pdsh, or have the script "
                         "`import shardwise.frontends.deepspeed.api as deepspeed`")
    master_addr = args.master_addr
    if not master_addr and launcher != "slurm":  # srun's ranks find rank 0 in SLURM's node list
        master_addr = _first_address(next(iter(hosts)), args)
    return _job(args, hosts, master_addr=master_addr)


def run_on_hosts(args: argparse.Namespace, job: Job) -> int:
    launcher = args.launcher or "ssh"
    if launcher == "ssh":
        require_program("ssh", launcher)
        return run_all(ssh_commands(job, ssh_port=args.ssh_port), list(job.hosts))
    if launcher == "pdsh":
        require_program("pdsh", launcher)
        os.environ["PDSH_RCMD_TYPE"] = "ssh"
        if args.ssh_port is not None:
            os.environ["PDSH_SSH_ARGS_APPEND"] = f"{os.environ.get('PDSH_SSH_ARGS_APPEND', '')} -p {args.ssh_port}"
        return run_one(pdsh_command(job))
    if launcher == "slurm":
        require_program("srun", launcher)
        filtered = bool(args.include or args.exclude)
        return run_one(srun_command(job, filtered=filtered, num_nodes=args.num_nodes, num_gpus=args.num_gpus))
    require_program("mpirun", launcher)
    return run_one(mpirun_command(job, hostfile=args.hostfile, pool=read_hostfile(args.hostfile)))


def _job(args: argparse.Namespace, hosts: dict[str, list[int]], *, master_addr: str) -> Job:
    node_options = ["--as-deepspeed"] if args.as_deepspeed else []
    if args.no_local_rank:
        node_options.append("--no-local-rank")
    if args.max_restarts:  # every node's agent restarts its workers (the hosts stay fixed)
        node_options += ["--max-restarts", str(args.max_restarts)]
    cwd = Path.cwd()
    return Job(
        hosts=hosts,
        master_addr=master_addr,
        master_port=args.master_port or DEFAULT_MASTER_PORT,
        script=os.path.abspath(args.script),
        script_args=list(args.script_args),
        exports=forwarded_variables(os.environ, cwd=cwd, home=Path.home()),
        cwd=str(cwd),
        node_options=node_options,
        launcher_args=shlex.split(args.launcher_args),
    )


def _first_address(host: str, args: argparse.Namespace) -> str:
    """The first host's first address, as DeepSpeed finds it (`hostname -I` over ssh)."""
    port = ["-p", str(args.ssh_port)] if args.ssh_port is not None else []
    ssh_options = shlex.split(args.launcher_args) if (args.launcher or "ssh") == "ssh" else []
    command = ["ssh", *port, *ssh_options, host, "hostname -I"]
    try:
        output = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError) as error:
        raise ValueError(f"could not ask {host} for its address ({shlex.join(command)}: {error}): "
                         "give --master_addr") from None
    if not output.split():
        raise ValueError(f"`hostname -I` on {host} printed no address: give --master_addr")
    return output.split()[0]
