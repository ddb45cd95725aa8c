"""`shardwise <command>`: one entry point, one module per command.

Each command module exposes `add_parser(subparsers)` and `main(args) -> int`; they are
imported lazily so `shardwise --help` does not pay for torch or transformers.
"""

from __future__ import annotations

import argparse
import importlib
import sys

LAUNCHING = ("train", "run")  # commands that start workers: stop signals end them (launcher/interrupts.py)
COMMANDS = {
    "train": "shardwise.tools.train.cli",
    "run": "shardwise.tools.launcher.cli",
    "estimate": "shardwise.tools.planner.cli",
    "tune": "shardwise.tools.planner.tune_cli",
    "convert": "shardwise.tools.convert",
    "data": "shardwise.tools.data.cli",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardwise", description="ZeRO-style memory-efficient training for PyTorch."
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module_name in COMMANDS.values():
        importlib.import_module(module_name).add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    command = (sys.argv[1:] if argv is None else argv)[:1]
    if command and command[0] in LAUNCHING:
        from shardwise.tools.launcher.interrupts import defer_stop_signals

        defer_stop_signals()
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
