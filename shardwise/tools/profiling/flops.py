"""Model FLOPs utilisation (MFU): the model's useful FLOPs per second over the hardware's peak.

MFU (Chowdhery et al., PaLM, appendix B) counts only the FLOPs the model needs
(`flops_per_token` x tokens/s), not recomputation or padding, so it compares runs and
systems fairly. The peak is a datasheet number for known GPUs (dense 16-bit tensor-core
throughput). For a CPU there is no datasheet number that means anything for a given
thread count, so the peak is *measured*: a large matmul in the training dtype, timed with
the threads this process trains with. MFU on CPU then answers "how close to a plain
matmul does training run".
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

# Dense bf16/fp16 tensor-core FLOP/s by device name, most specific names first
# (an "H100 PCIe" must not be read as an SXM "H100").
GPU_PEAK_FLOPS_16BIT: tuple[tuple[str, float], ...] = (
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("V100", 125e12),
    ("T4", 65e12),
)
SIXTEEN_BIT = (torch.bfloat16, torch.float16)
MEASURE_SECONDS = 0.25
MEASURE_TRIALS = 5


@dataclass(frozen=True)
class PeakFlops:
    """Peak FLOP/s of one device and where the number comes from."""

    flops_per_second: float
    source: str


def table_peak_flops(device_name: str, dtype: torch.dtype) -> float | None:
    """The datasheet peak for a known GPU in a 16-bit dtype, else None."""
    if dtype not in SIXTEEN_BIT:
        return None
    for name, peak in GPU_PEAK_FLOPS_16BIT:
        if name in device_name:
            return peak
    return None


def measure_matmul_flops(
    device: torch.device,
    dtype: torch.dtype,
    size: int | None = None,
    seconds: float = MEASURE_SECONDS,
    trials: int = MEASURE_TRIALS,
) -> float:
    """FLOP/s of repeated `size` x `size` matmuls: the best of `trials` timings of about
    `seconds / trials` each, after one warm-up. The best rather than the mean, because a
    peak is what the hardware can do, and on a shared machine some trials lose the core."""
    size = size or (1024 if device.type == "cpu" else 8192)
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.mm(a, b)
    synchronize()
    best = 0.0
    for _ in range(trials):
        count = 0
        started = time.perf_counter()
        while True:
            torch.mm(a, b)
            count += 1
            synchronize()
            elapsed = time.perf_counter() - started
            if elapsed >= seconds / trials:
                break
        best = max(best, 2.0 * size**3 * count / elapsed)
    return best


def device_peak_flops(device: torch.device, dtype: torch.dtype) -> PeakFlops:
    """Peak FLOP/s of `device` for `dtype`: the datasheet number when known, else measured."""
    dtype_name = str(dtype).removeprefix("torch.")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = table_peak_flops(name, dtype)
        if peak is not None:
            return PeakFlops(peak, f"datasheet: {name}, dense {dtype_name}")
        return PeakFlops(measure_matmul_flops(device, dtype), f"measured: {name}, {dtype_name} matmul")
    threads = torch.get_num_threads()
    return PeakFlops(
        measure_matmul_flops(device, dtype),
        f"measured: CPU {dtype_name} matmul, {threads} thread{'s' if threads > 1 else ''}",
    )


def model_flops_utilization(flops_per_token: float, tokens_per_second: float, peak_flops_per_second: float) -> float:
    """Achieved model FLOP/s over peak FLOP/s; both for the same set of devices.

    For a data-parallel job, use the global tokens/s with the summed peak of all ranks
    (or one rank's tokens/s with one device's peak: the ratio is the same).
    """
    if peak_flops_per_second <= 0:
        raise ValueError(f"peak FLOP/s must be positive, got {peak_flops_per_second}")
    if flops_per_token < 0 or tokens_per_second < 0:
        raise ValueError(
            f"FLOPs per token and tokens/s must be non-negative, got {flops_per_token} and {tokens_per_second}"
        )
    return flops_per_token * tokens_per_second / peak_flops_per_second
