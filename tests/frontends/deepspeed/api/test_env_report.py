"""`deepspeed.env_report`: the op report (nothing compiled, each op's Python class) and the
environment (torch, the compatibility package's version and place, /dev/shm); run as
`python -m deepspeed.env_report` under the alias (slow: a fresh interpreter)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from shardwise.frontends.deepspeed.alias import DEEPSPEED_API_VERSION, as_deepspeed_environment
from shardwise.frontends.deepspeed.api import env_report


def test_report_says_what_this_environment_is(capsys):
    env_report.main()
    out = capsys.readouterr().out
    assert "fused_adam ............. [NO] ....... [OKAY] (deepspeed.ops.adam.FusedAdam" in out
    assert f"torch version .................... {torch.__version__}\n" in out
    assert f"deepspeed info ................... {DEEPSPEED_API_VERSION}, [none], [none] (shardwise " in out
    assert "shared memory (/dev/shm) size ...." in out
    env_report.main(hide_operator_status=True)
    assert "op report" not in capsys.readouterr().out
    assert env_report.human_readable_size(3 * 1024**3) == "3.00 GB"


@pytest.mark.slow
def test_python_dash_m_under_the_alias():
    with as_deepspeed_environment() as environment:
        run = subprocess.run([sys.executable, "-m", "deepspeed.env_report"], env={**os.environ, **environment},
                             capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "DeepSpeed general environment info:" in run.stdout and "[OKAY]" in run.stdout
