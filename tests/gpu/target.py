"""Where the GPU tests run and how their ranks start (conftest.py says why).

`DEVICE` / `BACKEND` / `WORLD`: CUDA, NCCL and min(GPUs, 2) ranks on a GPU machine; CPU,
gloo and one rank in the CPU rehearsal (SHARDWISE_GPU_TESTS_ON_CPU=1). `run_ranks` starts
the ranks with the test-only switch that makes a world of one issue its collectives, and
checks that they did: on one GPU that is what proves the NCCL paths ran.
"""

from __future__ import annotations

import functools
import gc
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch

from shardwise.runtime.distributed.collectives import COLLECTIVES_AT_SIZE_ONE_VARIABLE
from shardwise.tools.testing import run_distributed
from tests.runtime.distributed.workers import counted_collectives

REHEARSAL = os.environ.get("SHARDWISE_GPU_TESTS_ON_CPU") == "1"
ON_CUDA = torch.cuda.is_available() and not REHEARSAL
RUNS = ON_CUDA or REHEARSAL
DEVICE = "cuda" if ON_CUDA else "cpu"
BACKEND = "nccl" if ON_CUDA else "gloo"
WORLD = min(torch.cuda.device_count(), 2) if ON_CUDA else 1

# Against the fp32 CPU reference. fp32: every CUDA kernel rounds differently from the CPU's
# (about 1e-7 relative), and Adam turns that noise in near-zero gradient entries into steps
# of size lr; at lr 1e-3 (not the CPU suite's 1e-2) it stays far below 1e-5, while a wrong
# gradient moves every weight by ~lr per step, 1e-2 of the tiny models' weights.
# bf16 keeps 8 significant bits (unit roundoff 2^-9, about 2e-3): each weight the model
# computes with is off by up to 2e-3 and a 2-layer forward's loss by a few times that; over
# the few Adam steps at lr 1e-3, whose direction bf16 gradients decide, 2e-2 (ten
# roundoffs) leaves room for that and none for a lost or doubled gradient.
LR = 1e-3
TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2}

# every tests/gpu module: `pytestmark = needs_target`
needs_target = pytest.mark.skipif(not RUNS, reason="needs CUDA (SHARDWISE_GPU_TESTS_ON_CPU=1 rehearses on CPU/gloo)")


def cuda_only(what: str) -> pytest.MarkDecorator:
    """For a check of something only CUDA has; the rehearsal says what it left out."""
    return pytest.mark.skipif(not ON_CUDA, reason=f"CPU rehearsal: {what} exists only on CUDA")


def on_target(rank: int, world_size: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> dict:
    """Rank body: full fp32 matmuls, then `fn`, counting the collectives it issues."""
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    with counted_collectives() as counts:
        result = fn(rank, world_size, *args, **kwargs)
    return {"result": result, "collectives": dict(counts)}


def run_ranks(fn: Callable[..., Any], *args: Any, collectives: bool = False, timeout: float = 240.0,
              **kwargs: Any) -> list[Any]:
    """`fn(rank, WORLD, *args, **kwargs)` on `WORLD` ranks of `BACKEND`; the results by rank
    (with `collectives`, (result, {operation: calls}) pairs). Fails if a rank issued no
    collective: every engine issues some, so none means the switch did not take."""
    env = {COLLECTIVES_AT_SIZE_ONE_VARIABLE: "1"}
    if REHEARSAL:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the engine then picks the CPU, as on a machine without GPUs
    runs = run_distributed(on_target, WORLD, fn, *args, backend=BACKEND, env=env, timeout=timeout, **kwargs)
    for rank, run in enumerate(runs):
        assert run["collectives"], f"rank {rank} issued no collective over {BACKEND}"
    return [(run["result"], run["collectives"]) if collectives else run["result"] for run in runs]


def launch_once(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Memoise a launch shared by several tests, its failure included: a launch that
    failed fails each test that reads it at once instead of being run again (GPU minutes)."""
    outcomes: dict[tuple, tuple[bool, Any]] = {}

    @functools.wraps(fn)
    def run(*args: Any) -> Any:
        if args not in outcomes:
            try:
                outcomes[args] = (True, fn(*args))
            except Exception as error:  # noqa: BLE001 - re-raised to every reader
                outcomes[args] = (False, error)
        succeeded, value = outcomes[args]
        if not succeeded:
            raise value
        return value

    return run


def pinned_host_bytes() -> int:
    """Bytes of page-locked host memory held by live tensors of this process (0 without CUDA)."""
    if not torch.cuda.is_available():
        return 0
    storages = {}
    for item in gc.get_objects():
        if isinstance(item, torch.Tensor) and item.device.type == "cpu" and item.is_pinned():
            storage = item.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())
