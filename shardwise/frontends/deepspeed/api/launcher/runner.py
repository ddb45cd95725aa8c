"""`deepspeed.launcher.runner`: the file of `NAME=VALUE` lines a multi-node launch exports
on every host, by DeepSpeed's names.

`DEEPSPEED_ENVIRONMENT_NAME` is `$DS_ENV_FILE`, else `.deepspeed_env`, looked for in
each of `DEEPSPEED_ENVIRONMENT_PATHS` (the home directory, then this one), as in
DeepSpeed; `shardwise run --hostfile` reads the same files by the same rule
(tools/launcher/forwarded_environment.py), so what `accelerate launch` appends there
reaches the other hosts. Read when imported, as DeepSpeed's is.
"""

from __future__ import annotations

import os

__all__ = ["DEEPSPEED_ENVIRONMENT_NAME", "DEEPSPEED_ENVIRONMENT_PATHS"]

DEEPSPEED_ENVIRONMENT_NAME = os.getenv("DS_ENV_FILE", ".deepspeed_env")
DEEPSPEED_ENVIRONMENT_PATHS = [os.path.expanduser("~"), "."]
