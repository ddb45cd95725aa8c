"""Create and refresh `.venv` so both README commands work on a machine with only Python.

torch is installed first and pinned (`torch==2.13.0`): left to resolve on its own, the
package's `torch>=2.13` requirement would pull the newest CUDA build and gigabytes of
CUDA libraries. The install is skipped when `pyproject.toml` has not changed since the
last one, so repeated runs start in seconds.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"
TORCH = "torch==2.13.0"
EXTRAS = "dev"


def venv_python() -> Path:
    return VENV / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def _fingerprint() -> str:
    text = (ROOT / "pyproject.toml").read_bytes() + TORCH.encode() + EXTRAS.encode()
    return hashlib.sha256(text).hexdigest()


def ensure_venv() -> Path:
    """Return the venv's python, creating the venv and installing the package if needed."""
    python = venv_python()
    stamp = VENV / ".shardwise-installed"
    if python.exists() and stamp.exists() and stamp.read_text() == _fingerprint():
        return python
    if not python.exists():
        print(f"creating {VENV}", flush=True)
        venv.EnvBuilder(with_pip=True).create(VENV)
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    print(f"installing {TORCH}", flush=True)
    subprocess.run([*pip, TORCH], check=True)
    print(f"installing shardwise[{EXTRAS}] (editable)", flush=True)
    subprocess.run([*pip, "-e", f"{ROOT}[{EXTRAS}]"], check=True)
    stamp.write_text(_fingerprint())
    return python


def exec_in_venv(args: list[str]) -> None:
    """Replace this process with `python args...` inside the venv."""
    python = ensure_venv()
    os.chdir(ROOT)
    os.execv(str(python), [str(python), *args])


if __name__ == "__main__":
    ensure_venv()
    sys.exit(0)
