"""`deepspeed.env_report` (`ds_report`): what a bug report asks for, about this
environment, in DeepSpeed 0.19.8's layout. `main()` prints the op report (the DeepSpeed
ops scripts ask about: none compiled here, each one done in Python by the class
api/ops/op_builder.py names) and the environment (torch, the compatibility package,
shardwise, the accelerator, /dev/shm). Run it as `python -m deepspeed.env_report` under
`shardwise run --as-deepspeed`, or `python -m shardwise.frontends.deepspeed.api.env_report`.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

import shardwise
from shardwise.frontends.deepspeed.api import git_version_info
from shardwise.frontends.deepspeed.api.ops.op_builder import (
    AsyncIOBuilder,
    CPUAdamBuilder,
    FusedAdamBuilder,
    FusedLambBuilder,
)
from shardwise.runtime.base.torch_compat import release_info

__all__ = ["cli_main", "debug_report", "get_shm_size", "human_readable_size", "main", "op_report", "parse_arguments"]

NAME_WIDTH = 33  # dots pad each name to this many characters, as DeepSpeed's report
OP_WIDTH, STATUS_WIDTH = 23, 11
SMALL_SHM = 512 * 1024**2  # below this, NCCL and data loader workers run out of shared memory


def op_report(verbose: bool = True) -> None:
    """Each op's row: installed (compiled) and compatible (usable): never compiled here,
    always usable through the Python class named after it. `verbose` is DeepSpeed's
    (its compatibility probes' messages); nothing is probed here."""
    rule = "-" * (OP_WIDTH + STATUS_WIDTH + len("op name") + len("installed"))
    print(rule)
    print("DeepSpeed C++/CUDA extension op report (shardwise: no extension is compiled)")
    print(rule)
    print("NOTE: shardwise builds no DeepSpeed extension; each op below is done in Python\n"
          "      by the class named after it.")
    print(rule)
    print("op name", "." * (OP_WIDTH - len("op name")), "installed", "." * (STATUS_WIDTH - len("installed")),
          "compatible")
    print(rule)
    for builder in (FusedAdamBuilder(), CPUAdamBuilder(), FusedLambBuilder(), AsyncIOBuilder()):
        usable = "[OKAY]" if builder.is_compatible() else "[NO]"
        print(builder.NAME, "." * (OP_WIDTH - len(builder.NAME)), "[NO]", "." * (STATUS_WIDTH - len("[NO]")),
              usable, f"({builder.REPLACEMENT})")
    print(rule)


def human_readable_size(size: float) -> str:
    units = ["B", "KB", "MB", "GB", "TB"]
    unit = 0
    while size >= 1024 and unit < len(units) - 1:
        size /= 1024
        unit += 1
    return f"{size:.2f} {units[unit]}"


def get_shm_size() -> tuple[str, list[str] | None]:
    """/dev/shm's size, readable, and warnings when it is small (a container's default 64 MB)."""
    try:
        stats = os.statvfs("/dev/shm")
    except (OSError, ValueError, AttributeError):
        return "UNKNOWN", None
    size = stats.f_frsize * stats.f_blocks
    warnings = []
    if size < SMALL_SHM:
        warnings.append(" [WARNING] /dev/shm size might be too small, if running in docker increase to at least "
                        "--shm-size='1gb'")
    return human_readable_size(size), warnings


def _report() -> list[tuple[str, object]]:
    package = Path(git_version_info.__file__).parent
    releases = release_info()
    rows: list[tuple[str, object]] = [
        ("torch install path", list(torch.__path__)),
        ("torch version", releases["torch"]),
        ("deepspeed install path", [str(package)]),
        ("deepspeed info", f"{git_version_info.version}, {git_version_info.git_hash}, {git_version_info.git_branch} "
                           f"(shardwise {shardwise.__version__}'s DeepSpeed API)"),
        ("accelerator", git_version_info.accelerator_name),
    ]
    if torch.cuda.is_available():
        rows += [("torch cuda version", releases["cuda"]), ("torch hip version", releases["hip"]),
                 ("nccl version", git_version_info.torch_info["nccl_version"])]
    rows.append(("deepspeed wheel compiled w.", "nothing compiled (shardwise runs DeepSpeed's API in Python)"))
    rows.append(("shared memory (/dev/shm) size", get_shm_size()))
    return rows


def debug_report() -> None:
    """The environment, one dotted row per item (DeepSpeed's "general environment info")."""
    print("DeepSpeed general environment info:")
    for name, value in _report():
        warnings: list[str] | None = None
        if isinstance(value, tuple):
            value, warnings = value
        print(name, "." * (NAME_WIDTH - len(name)), value)
        for warning in warnings or []:
            print(warning)


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hide_operator_status", action="store_true",
                        help="Suppress display of installation and compatibility statuses of DeepSpeed operators.")
    parser.add_argument("--hide_errors_and_warnings", action="store_true", help="Suppress warning and error messages.")
    return parser.parse_args()


def main(hide_operator_status: bool = False, hide_errors_and_warnings: bool = False) -> None:
    if not hide_operator_status:
        op_report(verbose=not hide_errors_and_warnings)
    debug_report()


def cli_main() -> None:
    args = parse_arguments()
    main(hide_operator_status=args.hide_operator_status, hide_errors_and_warnings=args.hide_errors_and_warnings)


if __name__ == "__main__":
    main()
