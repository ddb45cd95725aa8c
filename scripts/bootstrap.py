"""Set up the Python that both README commands run in.

By default: create and refresh `.venv`, so the commands work on a machine with only
Python. torch is installed first and pinned (`torch==2.13.0`): left to resolve on its
own, the package's `torch>=2.9` requirement would pull the newest CUDA build and
gigabytes of CUDA libraries. The install is skipped when `pyproject.toml` has not changed
since the last one, so repeated runs start in seconds.

With `SHARDWISE_PYTHON_ENV=current`: use the running interpreter instead (a GPU image
whose torch is already there). Its torch must satisfy pyproject.toml's requirement and is
never installed, upgraded or replaced. Every other requirement (the package's and the
command's extra: `dev` for the tests, `plots` for the training job) is checked with
importlib.metadata, and only those absent or at a version outside their range are
installed, under a constraint pinning the torch found. When nothing is missing, pip does
not run at all. When a `.whl/` folder of wheels
sits beside pyproject.toml, pip installs from it alone, without the network. The checkout
itself is put on PYTHONPATH rather than installed.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import re
import subprocess
import sys
import tempfile
import tomllib
import venv
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"
WHEELS = ROOT / ".whl"
TORCH = "torch==2.13.0"
EXTRAS = "dev"
ENVIRONMENT_SWITCH = "SHARDWISE_PYTHON_ENV"


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
    # --no-compile: pip would byte-compile every module of torch and the extras (about 30 s
    # of a 90 s set-up here); Python compiles the ones a run imports, once, on first import
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "--no-compile", "-q"]
    print(f"installing {TORCH}", flush=True)
    subprocess.run([*pip, TORCH], check=True)
    print(f"installing shardwise[{EXTRAS}] (editable)", flush=True)
    subprocess.run([*pip, "-e", f"{ROOT}[{EXTRAS}]"], check=True)
    stamp.write_text(_fingerprint())
    return python


# -- the running interpreter (SHARDWISE_PYTHON_ENV=current) ------------------------------

_REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*([^;#]*)")
_CLAUSE = re.compile(r"^\s*(>=|<=|==|!=|>|<)\s*([0-9][0-9.]*)\s*$")


def requirements(extra: str) -> list[str]:
    """pyproject.toml's requirements: the package's, then `extra`'s."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [*project["dependencies"], *project["optional-dependencies"][extra]]


def _release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: "2.11.0+cu128" -> (2, 11, 0)."""
    digits = re.match(r"[0-9]+(?:\.[0-9]+)*", version)
    if digits is None:
        raise ValueError(f"cannot read the version {version!r}")
    return tuple(int(part) for part in digits.group().split("."))


def _compare(left: tuple[int, ...], right: tuple[int, ...]) -> int:
    width = max(len(left), len(right))
    left, right = left + (0,) * (width - len(left)), right + (0,) * (width - len(right))
    return (left > right) - (left < right)


def satisfies(version: str, specifier: str) -> bool:
    """Whether `version` meets a specifier such as ">=5.18,<5.24" (the operators used in
    pyproject.toml; this runs before anything is installed, so it cannot use `packaging`)."""
    tests = {">=": lambda c: c >= 0, "<=": lambda c: c <= 0, ">": lambda c: c > 0,
             "<": lambda c: c < 0, "==": lambda c: c == 0, "!=": lambda c: c != 0}
    for clause in filter(None, (part.strip() for part in specifier.split(","))):
        match = _CLAUSE.match(clause)
        if match is None:
            raise ValueError(f"bootstrap.py cannot read the version specifier {clause!r}; "
                             f"it understands {', '.join(tests)} followed by a release number")
        operator, bound = match.groups()
        if not tests[operator](_compare(_release(version), _release(bound))):
            return False
    return True


def missing_requirements(wanted: list[str], installed: Mapping[str, str | None]) -> list[str]:
    """The requirements of `wanted` that `installed` (name -> version, None when absent)
    does not meet. torch is never among them: the running interpreter's torch either meets
    its requirement or this raises SystemExit saying so, because installing torch into a
    user's environment would replace the build (CUDA, ROCm) they chose."""
    missing = []
    for requirement in wanted:
        name, specifier = _REQUIREMENT.match(requirement).groups()
        version = installed.get(name)
        if name == "torch":
            if version is None or not satisfies(version, specifier):
                found = "no torch" if version is None else f"torch {version}"
                raise SystemExit(
                    f"{ENVIRONMENT_SWITCH}=current: {sys.executable} has {found}, and shardwise needs "
                    f"{requirement.strip()}; install a torch in that range into it, or unset "
                    f"{ENVIRONMENT_SWITCH} to use .venv")
        elif version is None or not satisfies(version, specifier):
            missing.append(requirement.strip())
    return missing


def pip_install_command(python: str, missing: list[str], constraint: Path, wheels: Path | None) -> list[str]:
    """pip installing `missing` without touching torch: `constraint` is a file pinning the
    torch found (`torch==<version>`), so a requirement that needs another torch fails
    instead of replacing it. Offline, from `wheels` alone, when given."""
    command = [python, "-m", "pip", "install", "--disable-pip-version-check", "-q", "-c", str(constraint)]
    if wheels is not None:
        command += ["--no-index", "--find-links", str(wheels)]
    return [*command, *missing]


def _installed_versions(wanted: list[str]) -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for requirement in wanted:
        name = _REQUIREMENT.match(requirement).group(1)
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def ensure_current_python(extra: str) -> Path:
    """Return the running interpreter after installing what it and `extra` lack (never torch)."""
    wanted = requirements(extra)
    installed = _installed_versions(wanted)
    missing = missing_requirements(wanted, installed)
    if missing:
        wheels = WHEELS if WHEELS.is_dir() else None
        source = f"from {wheels} (no network)" if wheels else "from the package index"
        print(f"installing into {sys.executable} {source}: {' '.join(missing)} "
              f"(keeping torch {installed['torch']})", flush=True)
        with tempfile.TemporaryDirectory() as directory:
            constraint = Path(directory) / "torch.txt"
            constraint.write_text(f"torch=={installed['torch']}\n")
            subprocess.run(pip_install_command(sys.executable, missing, constraint, wheels), check=True)
    # The checkout runs from its folder, in this process and in the ranks it starts.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return Path(sys.executable)


def ensure_python(extra: str = EXTRAS) -> Path:
    """The interpreter the README commands run in: `.venv` (always with the `dev` extra),
    or the running one when SHARDWISE_PYTHON_ENV=current, completed with what the command's
    `extra` needs: `dev` for the tests, `plots` for the training job."""
    choice = os.environ.get(ENVIRONMENT_SWITCH, "")
    if choice == "current":
        return ensure_current_python(extra)
    if choice not in ("", "venv"):
        raise SystemExit(f"{ENVIRONMENT_SWITCH}={choice!r}: expected 'current' (use this Python and its torch) "
                         "or 'venv' (create .venv, the default)")
    return ensure_venv()


def exec_in_python(args: list[str], extra: str = EXTRAS) -> None:
    """Replace this process with `python args...` in the chosen interpreter."""
    python = ensure_python(extra)
    os.chdir(ROOT)
    os.execv(str(python), [str(python), *args])


if __name__ == "__main__":
    ensure_python()
    sys.exit(0)
