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
CASE_COUNT = 15  # the parametrised cases in triton_interpreted.py


def test_the_kernels_compute_what_the_torch_path_does_under_the_interpreter():
    repository = Path(__file__).resolve().parents[3]
    environment = {**os.environ, "TRITON_INTERPRET": "1", "SHARDWISE_NATIVE_OPTIM": "0"}
    run = subprocess.run([sys.executable, "-m", "pytest", str(CASES), "-q", "-p", "no:cacheprovider"],
                         cwd=repository, env=environment, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert re.search(rf"\b{CASE_COUNT} passed\b", run.stdout), run.stdout[-2000:]


COMPILE_FOR_HOPPER = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from shardwise.runtime.optim import triton_kernels as kernels

pointers = dict(param="*fp32", grad="*fp32", m_codes="*u8", m_absmax="*fp32", v_codes="*u8", v_absmax="*fp32",
                m_fp32="*fp32", v_fp32="*fp32", edges="*fp32", m_values="*fp32", m_rounding="*i32",
                v_values="*fp32", v_rounding="*i32")
scalars = {name: "i32" for name in ("numel", "offset", "rows")} | {name: "fp32" for name in (
    "beta1", "beta1_complement", "beta2", "beta2_complement", "eps", "decay_factor", "correction2", "step_scale")}
constants = dict(FROM_FP32=False, DECAY=True, TINY=1e-38, BLOCK=256)
source = ASTSource(kernels._adam8bit_kernel, pointers | scalars | {name: "constexpr" for name in constants},
                   constexprs=constants)
print(sorted(triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm))
"""


def test_the_8bit_adam_kernel_compiles_for_an_h100_without_one():
    """Triton lowers the kernel through PTX to a cubin for sm_90 with its own ptxas, no GPU
    needed: what the interpreter cannot check (types, constexprs, the backend's passes) is
    checked here, before a lent GPU's minutes are spent on it."""
    run = subprocess.run([sys.executable, "-c", COMPILE_FOR_HOPPER], cwd=Path(__file__).resolve().parents[3],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "'cubin'" in run.stdout, run.stdout
