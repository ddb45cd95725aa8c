"""`deepspeed.add_config_arguments`: the command-line flags DeepSpeed adds to a script's
parser. `--deepspeed` and `--deepscale` are flags for the script's own use;
`--deepspeed_config` is the JSON config `initialize` reads from `args`."""

from __future__ import annotations

import argparse

__all__ = ["add_config_arguments"]


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations (run by shardwise)")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="enable DeepSpeed (a flag for the script's own use)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed JSON configuration file")
    group.add_argument("--deepscale", default=False, action="store_true", help="deprecated: --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str, help="deprecated: --deepspeed_config")
    return parser
