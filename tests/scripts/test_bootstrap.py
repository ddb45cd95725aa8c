"""scripts/bootstrap.py's choice of what to install into an existing environment
(SHARDWISE_PYTHON_ENV=current): only what is missing, never torch, and no pip at all when
nothing is missing. No network: pip is replaced by a recorder wherever it would run."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bootstrap", ROOT / "scripts" / "bootstrap.py")
bootstrap = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bootstrap)

# The lent GPU machine's image: Python 3.12, CUDA torch 2.11, transformers 5.17.
GPU_IMAGE = {"torch": "2.11.0+cu128", "transformers": "5.17.0", "accelerate": "1.15.0", "numpy": "2.2.6",
             "safetensors": "0.6.2", "rich": "14.1.0", "pydantic": None}


def test_version_specifiers_are_read_as_pip_reads_them():
    assert bootstrap.satisfies("2.11.0+cu128", ">=2.9")
    assert bootstrap.satisfies("2.9", ">=2.9.0")
    assert not bootstrap.satisfies("2.8.0", ">=2.9")
    assert bootstrap.satisfies("5.23.0", ">=5.18,<5.24")
    assert not bootstrap.satisfies("5.24.0", ">=5.18,<5.24")
    assert not bootstrap.satisfies("5.17.0", ">=5.18,<5.24")
    assert bootstrap.satisfies("1.0", "")
    with pytest.raises(ValueError, match="~="):
        bootstrap.satisfies("1.0", "~=1.0")


def test_missing_are_the_absent_and_the_out_of_range_never_torch():
    wanted = ["torch>=2.9", "pydantic>=2.6", "rich>=13", "transformers>=5.18,<5.24", "accelerate>=1.10,<2"]
    assert bootstrap.missing_requirements(wanted, GPU_IMAGE) == ["pydantic>=2.6", "transformers>=5.18,<5.24"]


@pytest.mark.parametrize("torch_version", [None, "2.8.0"])
def test_a_torch_outside_the_requirement_is_refused_not_installed(torch_version):
    with pytest.raises(SystemExit, match=r"torch>=2\.9.*unset SHARDWISE_PYTHON_ENV"):
        bootstrap.missing_requirements(["torch>=2.9", "rich>=13"], {"torch": torch_version, "rich": "14.0"})


def test_pyproject_requirements_name_torch_and_the_extras():
    names = [bootstrap._REQUIREMENT.match(r).group(1) for r in bootstrap.requirements("dev")]
    assert names[0] == "torch" and "pydantic" in names and "pytest" in names
    assert "pytest" not in [bootstrap._REQUIREMENT.match(r).group(1) for r in bootstrap.requirements("plots")]


def _record_pip(monkeypatch) -> list[tuple[list[str], str]]:
    calls = []

    def run(command, check=False, **kwargs):
        constraint = Path(command[command.index("-c") + 1]).read_text()
        calls.append((command, constraint))
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(bootstrap.subprocess, "run", run)
    monkeypatch.setenv("PYTHONPATH", "")
    return calls


def test_only_the_missing_are_installed_with_torch_pinned_offline_from_the_wheel_folder(monkeypatch, tmp_path):
    calls = _record_pip(monkeypatch)
    monkeypatch.setattr(bootstrap, "_installed_versions", lambda wanted: {**GPU_IMAGE})
    monkeypatch.setattr(bootstrap, "WHEELS", tmp_path)
    monkeypatch.setenv("SHARDWISE_PYTHON_ENV", "current")
    assert bootstrap.ensure_python("dev") == Path(sys.executable)
    [(command, constraint)] = calls
    assert constraint == "torch==2.11.0+cu128\n"
    assert command[command.index("--find-links") + 1] == str(tmp_path) and "--no-index" in command
    requested = command[command.index(str(tmp_path)) + 1:]
    assert "pydantic>=2.6" in requested  # the image's transformers 5.17 and accelerate 1.15 are in range
    assert not [r for r in requested
                if r.startswith(("torch", "transformers", "accelerate", "numpy", "rich", "safetensors"))]
    assert str(ROOT) in bootstrap.os.environ["PYTHONPATH"].split(bootstrap.os.pathsep)


def test_without_a_wheel_folder_pip_uses_the_index(monkeypatch, tmp_path):
    calls = _record_pip(monkeypatch)
    monkeypatch.setattr(bootstrap, "_installed_versions", lambda wanted: {**GPU_IMAGE})
    monkeypatch.setattr(bootstrap, "WHEELS", tmp_path / "absent")
    bootstrap.ensure_current_python("plots")
    [(command, _)] = calls
    assert "--no-index" not in command and "pydantic>=2.6" in command


def test_nothing_missing_runs_no_pip(monkeypatch):
    """This very interpreter runs the tests, so it has every `dev` requirement."""
    calls = _record_pip(monkeypatch)
    monkeypatch.setenv("SHARDWISE_PYTHON_ENV", "current")
    bootstrap.ensure_python("dev")
    assert calls == []


def test_an_unknown_choice_is_refused(monkeypatch):
    monkeypatch.setenv("SHARDWISE_PYTHON_ENV", "system")
    with pytest.raises(SystemExit, match="expected 'current'"):
        bootstrap.ensure_python("dev")
