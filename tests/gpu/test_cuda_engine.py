"""The engine on CUDA (docs/development.md#how-shardwise-is-tested): every ZeRO stage, gradient accumulation, LoRA's frozen
units and a forward-only engine, each against the single-process fp32 CPU reference.

On one GPU the ranks are a world of one whose collectives are real NCCL calls (the
test-only switch, see conftest.py); the collectives each stage issued are asserted, so a
run that silently skipped them cannot pass.
"""

import pytest
import torch

from shardwise.runtime.base.torch_compat import STORAGES_SWAP
from shardwise.tools.testing import run_distributed
from tests.gpu.ranks import train_cases
from tests.gpu.target import (BACKEND, DEVICE, LR, REHEARSAL, TOLERANCE, WORLD, launch_once, needs_target, on_target,
                              run_ranks)
from tests.runtime.zero.test_sole_param_home import COPYING, train_noting_home
from tests.runtime.zero.workers import Case, assert_matches_reference, relative_error, train_reference

pytestmark = needs_target

STAGE3 = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}


def case(stage: int, dtype: str = "fp32", **changes) -> Case:
    return Case(stage=stage, dtype=dtype, lr=LR, extra_config=STAGE3 if stage == 3 else {}, **changes)


@launch_once
def stage_runs(dtype: str) -> list[list[dict]]:
    """Per rank, the runs of stages 0-3, one launch."""
    return run_ranks(train_cases, [case(stage, dtype) for stage in range(4)])


@launch_once
def accumulation_runs() -> list[list[dict]]:
    return run_ranks(train_cases, [case(stage, accumulation=2) for stage in (1, 2, 3)])


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_stages_on_cuda_match_the_reference(stage, dtype):
    """Stage 0 in bf16 steps once on zero gradients when built, as DeepSpeed does; the
    reference takes that step too (train_reference)."""
    expected = train_reference(case(stage, dtype), WORLD)
    for runs in stage_runs(dtype):
        run = runs[stage]
        assert run["device"] == DEVICE
        assert_matches_reference(run, expected, TOLERANCE[dtype])
        issued = run["collectives"]
        # gradients summed over the shard group and the replicas; initial weights broadcast
        assert issued.get("reduce_scatter", 0) > 0 and issued.get("all_reduce", 0) > 0, issued
        assert issued.get("broadcast", 0) > 0, issued
        if stage > 0:  # updated partitions (1-2) or units before use (3) gathered
            assert issued.get("all_gather", 0) > 0, issued


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_gradient_accumulation_on_cuda_matches_the_reference(stage):
    """Two micro-batches per step: the window's gradients accumulate on the device (stage
    1) or in the reduced partition (2-3) before one update. The reference sums the
    micro-batches in the same order."""
    expected = train_reference(Case(lr=LR, accumulation=2), WORLD, per_micro_batch=True)
    for runs in accumulation_runs():
        assert_matches_reference(runs[stage - 1], expected, TOLERANCE["fp32"])


def test_lora_with_frozen_weights_partitioned_on_cuda():
    """LoRA at ZeRO-3 (tests/runtime/zero/test_frozen_stage3.py) on CUDA: frozen units gathered,
    freed after their input gradients, training equal to plain torch."""
    from tests.runtime.zero.test_frozen_stage3 import STEPS as LORA_STEPS
    from tests.runtime.zero.test_frozen_stage3 import train_parallel as train_lora
    from tests.runtime.zero.test_frozen_stage3 import train_reference as lora_reference

    expected = lora_reference(WORLD)
    for rank, result in enumerate(run_ranks(train_lora, 3, False, None)):
        for step in range(LORA_STEPS):
            want = expected["losses"][step][rank]
            assert abs(result["losses"][step] - want) < 1e-5 * abs(want)
        for name, weight in expected["weights"].items():
            assert ((result["weights"][name] - weight).norm() / weight.norm()).item() < 1e-5, name


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_forward_only_reference_engine_on_cuda(dtype):
    """An engine without an optimizer beside a trained one (tests/runtime/zero/test_forward_only.py), ZeRO-3, on CUDA."""
    from tests.runtime.zero.test_forward_only import MICRO, STEPS as REFERENCE_STEPS, rlhf_parallel, rlhf_reference

    expected = rlhf_reference(WORLD)
    for rank, result in enumerate(run_ranks(rlhf_parallel, 3, dtype)):
        rows = torch.cat([expected["reference_logits"][s * MICRO * WORLD + rank * MICRO:][:MICRO]
                          for s in range(REFERENCE_STEPS)])
        error = ((result["reference_logits"] - rows).norm() / rows.norm()).item()
        assert error < TOLERANCE[dtype]
        assert len(result["refused"]) == 2 and result["optimizer"] is None


def test_stage3_on_one_gpu_points_its_units_at_their_shards():
    """One rank without the test-only switch, as one GPU runs ZeRO-3: the units point at
    their shards instead of being copied into gather buffers (zero/sole_param_home.py),
    and train as the copying gathers and the reference do. (On CUDA, atomics in backward
    may change the last bits from run to run: the two compare at 1e-6, not bit for bit.)
    A torch without storage swaps (2.11, the GPU machine's: base/torch_compat.py) copies:
    then the home must not be built, and the run must still train as the reference does."""
    case = Case(stage=3, lr=LR, accumulation=2, extra_config=STAGE3)
    hidden = {"CUDA_VISIBLE_DEVICES": ""} if REHEARSAL else {}
    sole, copying = (run_distributed(on_target, 1, train_noting_home, case, backend=BACKEND,
                                     env={**hidden, **env})[0]["result"] for env in ({}, COPYING))
    assert sole["homes"] == ["SoleParamHome" if STORAGES_SWAP else "NoneType"] and copying["homes"] == ["NoneType"]
    if STORAGES_SWAP:
        assert sole["buffer_fills"] == sole["units"] < copying["buffer_fills"]
    assert_matches_reference(sole, train_reference(Case(lr=LR, accumulation=2), 1, per_micro_batch=True), 1e-5)
    for name, weight in copying["params"].items():
        assert relative_error(sole["params"][name], weight) < 1e-6, name
