"""The environment a multi-node launch carries to the other hosts, as DeepSpeed's does.

ssh and pdsh start the remote command in a fresh login environment, so what the job
needs from this shell has to be exported in the command: DeepSpeed forwards the
variables whose names start with NCCL, PYTHON, MLFLOW, MV2 or UCX (PYTHONPATH with this
directory put first, so the script's own modules import on every host), then the lines
`NAME=VALUE` of a `.deepspeed_env` file in the home directory and in this directory (its
name taken from DS_ENV_FILE), later ones winning. Values are written into the remote
shell command as DeepSpeed writes them: in double quotes when they hold anything but
`[A-Za-z0-9_@%+=:,./-]`, so that `$VAR` in a `.deepspeed_env` expands on the remote host.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

FORWARDED_PREFIXES = ("NCCL", "PYTHON", "MLFLOW", "MV2", "UCX")
ENV_FILE_VARIABLE = "DS_ENV_FILE"
DEFAULT_ENV_FILE = ".deepspeed_env"
# On AISC clusters each node sets these itself: forwarding rank 0's would be wrong.
_NODE_OWN = {"AISC_JOB_NAME": ("NCCL_IB_HCA", "UCX_NET_DEVICES")}
_PLAIN_VALUE = re.compile(r"[\w@%+=:,./-]*")


def forwarded_variables(environ: Mapping[str, str], *, cwd: Path, home: Path) -> dict[str, str]:
    """Name -> value of what every host's command exports, values as given (unquoted)."""
    own = {name for marker, names in _NODE_OWN.items() if marker in environ for name in names}
    python_path = os.pathsep.join(part for part in (str(cwd), environ.get("PYTHONPATH", "")) if part)
    environment = {**environ, "PYTHONPATH": python_path}
    forwarded = {
        name: value for name, value in environment.items()
        if name.startswith(FORWARDED_PREFIXES) and name not in own
    }
    file_name = environ.get(ENV_FILE_VARIABLE, DEFAULT_ENV_FILE)
    for directory in (home, cwd):
        path = directory / file_name
        if path.is_file():
            forwarded.update(read_env_file(path))
    return forwarded


def read_env_file(path: Path) -> dict[str, str]:
    """`NAME=VALUE` lines (blank lines and `#` comments skipped), stripped as DeepSpeed
    strips them."""
    variables = {}
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, separator, value = line.partition("=")
        if not separator or not name.strip():
            raise ValueError(f"{path}:{number}: {line!r} is not NAME=VALUE")
        variables[name.strip()] = value.strip()
    return variables


def shell_value(value: str) -> str:
    """The value as DeepSpeed puts it after `export NAME=` in the remote command."""
    value = value.strip()
    return value if _PLAIN_VALUE.fullmatch(value) else f'"{value}"'


def export_commands(variables: Mapping[str, str]) -> str:
    return "".join(f"export {name}={shell_value(value)}; " for name, value in variables.items())
