"""tests/gpu: the CUDA-specific code paths (docs/development.md#how-shardwise-is-tested), run whenever a GPU machine is lent.

Without CUDA every test here is skipped, unless SHARDWISE_GPU_TESTS_ON_CPU=1 is set: then
the same test bodies run on CPU with gloo (target.py: device "cpu", backend "gloo", CUDA
hidden from the ranks), a rehearsal that checks their logic, workers and references
before a GPU session spends its minutes on them. What exists only on CUDA (pinned memory,
side streams, flex attention and Triton kernels, NCCL) is skipped or checked in its CPU
form then, each with its reason. The variable is read by tests/gpu alone.

On one GPU the ranks run as a world of one with SHARDWISE_COLLECTIVES_AT_WORLD_SIZE_1=1
(distributed/collectives.py), so every collective ZeRO issues is a real NCCL call; with
two or more GPUs, two ranks over NCCL.
"""

import pytest
import torch

from tests.gpu.target import BACKEND, DEVICE, REHEARSAL, RUNS, WORLD


def pytest_report_header(config):
    if REHEARSAL:
        return "tests/gpu: rehearsal on CPU/gloo (SHARDWISE_GPU_TESTS_ON_CPU=1)"
    if RUNS:
        return f"tests/gpu: {torch.cuda.get_device_name()} x{torch.cuda.device_count()}, {WORLD} rank(s) over {BACKEND}"
    return None


@pytest.fixture(autouse=True)
def full_fp32_matmuls():
    """fp32 comparisons need fp32 arithmetic: TF32 (10-bit mantissa) would round every
    product to ~1e-3, far past their 1e-5 (the ranks set the same in `on_target`)."""
    if DEVICE == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    yield
