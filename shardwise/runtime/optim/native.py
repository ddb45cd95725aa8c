"""One-pass CPU optimizer kernels (native_kernels.c), compiled on first use.

An optimizer step is memory-bound: torch's fused AdamW reads and writes each array once.
LAMB, LARS, 8-bit Adam, Adafactor and the 1-bit optimizers' compression written in torch
operations make one pass per operation (8-bit Adam's decode, update, block maxima and
encode over thirty), and torch has no fused kernel for them; Inductor's loops come
closest but cost a call and guards per tensor and tens of seconds of compiling. So, as
DeepSpeed's CPU Adam does, the loops are C: built once per machine with the system's C
compiler (about a second; OpenMP where the compiler has it) into a cache directory,
loaded with ctypes (no torch headers, so any torch).

Without a compiler, or with `SHARDWISE_NATIVE_OPTIM=0`, or for tensors the kernels do not
take (not CPU, not contiguous fp32), the optimizers take their torch path, which computes
the same arithmetic (bit for bit but for the squared norms' summation order, and
Adafactor's U, which the kernels compute without a division per element); a missing
compiler is warned about once. The 1-bit exchange's kernels are used by
optim/onebit_exchange.py.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch

from shardwise.runtime.base.native_build import CompiledLibrary, build_once

SOURCE = Path(__file__).with_name("native_kernels.c")
ENABLE_VARIABLE = "SHARDWISE_NATIVE_OPTIM"
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC")

_F, _D, _I, _L, _P = ctypes.c_float, ctypes.c_double, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
_SIGNATURES = {
    "lamb_moments_and_squares": [_P, _P, _P, _P, _L, _F, _F, _F, _F, _F, _I, _P, _I],
    "lamb_apply": [_P, _P, _P, _L, _F, _F, _F, _I, _I],
    "two_squares": [_P, _P, _L, _P, _I],
    "lars_apply": [_P, _P, _P, _L, _F, _F, _F, _F, _I, _I, _F, _I],
    "adam8bit_step": [_P, _P, _P, _P, _P, _P, _L, _L, _P, _P, _P, _P, _F, _F, _F, _F, _F, _F, _I, _F, _F, _P, _P, _P,
                      _I],
    "adam8bit_steps": [_P, _L, _P, _P, _P, _P, _I],
    "adam8bit_fp32_moments": [_P, _L],
    "adam8bit_fp32_apply": [_P, _L],
    "quantize_values": [_P, _P, _L, _F, _P],
    "adafactor_squares": [_P, _P, _L, _L, _L, _L, _P, _P, _P, _I],
    "adafactor_update_square": [_P, _L, _L, _L, _L, _P, _P, _P, _F, _P, _I],
    "adafactor_apply": [_P, _P, _L, _L, _L, _L, _P, _P, _P, _F, _F, _I, _F, _I],
    "adafactor_advance_whole": [_P, _P, _P, _P, _L, _L, _L, _L, _F],
    "adafactor_vector_squares": [_P, _P, _P, _L, _F, _F, _P, _P],
    "adafactor_vector_apply": [_P, _P, _P, _L, _F, _F, _I, _F],
    "onebit_settle": [_P, _L, _P, _F],
    "onebit_worker_compress": [_P, _P, _L, _L, _L, _L, _P, _P, _P, _P, _P, _P, _P, _P, _P],
    "onebit_server_compress": [_P, _L, _P, _L, _L, _P, _P, _F, _P, _P],
    "onebit_decode_apply": [_P, _L, _P, _L, _L, _L, _P, _P, _P, _F, _F, _F, _I],
    "onebit_decode_adam_apply": [_P, _L, _P, _L, _P, _L, _P, _P, _P],
    "momentum_fold": [_P, _P, _L, _F, _F],
    "onebit_lamb_statistics": [_P, _P, _P, _P, _P, _L, _F, _F, _F, _F, _F, _I, _F, _P],
    "onebit_lamb_decode_statistics": [_P, _L, _P, _L, _L, _P, _P, _P, _P, _P, _P, _L, _F, _F, _F, _F, _F, _I, _F,
                                      _P],
    "onebit_lamb_decode_steps": [_P, _L, _P, _L, _P, _P, _P, _L, _P, _P],
}
# Kernels that return a value (the others return nothing), where the library has them:
# `use_avx512` and `use_avx512_vbmi` exist only where the compiler targets x86-64.
_RESULTS = {"use_avx512": ([_I], _I), "use_avx512_vbmi": ([_I], _I)}


def enabled() -> bool:
    """Whether the kernels are in use (`SHARDWISE_NATIVE_OPTIM=0` turns them off)."""
    return os.environ.get(ENABLE_VARIABLE, "1") != "0" and library() is not None


def library() -> ctypes.CDLL | None:
    """The compiled kernels, built on first call (None, warned once, where they cannot be)."""
    return _compiled.get()


def takes(*tensors: torch.Tensor) -> bool:
    """Whether the kernels can run on these tensors in place: CPU, contiguous; the caller
    checks dtypes."""
    return all(t.is_cpu and t.is_contiguous() for t in tensors)  # (is_cpu: no device object per tensor)


def pointer(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def threads() -> int:
    return torch.get_num_threads()


def _build() -> Path:
    return build_once(SOURCE, folder="optim", flags=FLAGS,
                      variants=(["-fopenmp"], ["-fopenmp-simd"], []), libraries=["-lm"])  # OpenMP where it exists


def _load(path: Path) -> ctypes.CDLL:
    library = ctypes.CDLL(str(path))
    for name, arguments in _SIGNATURES.items():
        function = getattr(library, name)
        function.argtypes, function.restype = arguments, None
    for name, (arguments, result) in _RESULTS.items():
        if hasattr(library, name):
            function = getattr(library, name)
            function.argtypes, function.restype = arguments, result
    return library


def use_avx512(enable: bool) -> bool:
    """Turns the 8-bit Adam and 1-bit kernels' AVX-512 blocks on (where the CPU has AVX-512) or off,
    so that tests can compare them with the portable loops on one machine; returns whether
    they are on. They are on by default wherever the CPU has them."""
    kernels = library()
    return kernels is not None and hasattr(kernels, "use_avx512") and bool(kernels.use_avx512(int(enable)))


def use_avx512_vbmi(enable: bool) -> bool:
    """Turns the AVX-512 blocks' VBMI decode of 8-bit codes (byte permutes) on, where the
    CPU has AVX-512 VBMI and the blocks are on, or off (gathers), so that tests can compare
    the two; returns whether it is on. `use_avx512(True)` turns it back on."""
    kernels = library()
    return kernels is not None and hasattr(kernels, "use_avx512_vbmi") and bool(kernels.use_avx512_vbmi(int(enable)))


_compiled = CompiledLibrary(lambda: _load(_build()), what="the one-pass optimizer kernels",
                            fallback="LAMB, LARS, 8-bit Adam, Adafactor and the 1-bit optimizers take their slower "
                                     "torch path.")
