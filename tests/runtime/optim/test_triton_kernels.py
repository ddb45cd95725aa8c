"""The GPU kernels of LAMB and 8-bit Adam (optim/triton_kernels.py) on the CPU: the cases
in triton_interpreted.py, run by Triton's interpreter in a pytest process of their own
(Triton fixes its functions' mode, compiled or interpreted, when it is first imported, so
the interpreter is a whole process's setting)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="Triton installs on Linux x86-64 (the dev extra); the kernels run on GPUs")

CASES = Path(__file__).with_name("triton_interpreted.py")
CASE_COUNT = 13  # the parametrised cases in triton_interpreted.py


def test_the_kernels_compute_what_the_torch_path_does_under_the_interpreter():
    repository = Path(__file__).resolve().parents[3]
    environment = {**os.environ, "TRITON_INTERPRET": "1", "SHARDWISE_NATIVE_OPTIM": "0"}
    run = subprocess.run([sys.executable, "-m", "pytest", str(CASES), "-q", "-p", "no:cacheprovider"],
                         cwd=repository, env=environment, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert re.search(rf"\b{CASE_COUNT} passed\b", run.stdout), run.stdout[-2000:]
