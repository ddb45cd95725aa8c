"""GPU checks (docs/development.md#how-shardwise-is-tested): skipped without CUDA; run them whenever a GPU machine is lent
and record what they show in BENCHMARKS.md.

On one GPU they train every stage on CUDA tensors (NCCL group of one, gloo control group)
against the single-process reference; with two or more GPUs, across GPUs over NCCL.
"""

import pytest
import torch

from shardwise.testing import run_distributed
from tests.zero.workers import Case, assert_matches_reference, train_parallel, train_reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
STAGE3 = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_stages_on_cuda_match_the_reference(stage, dtype):
    world = min(GPUS, 2)
    lr = 1e-2 if dtype == "fp32" else 1e-3
    case = Case(stage=stage, dtype=dtype, lr=lr, extra_config=STAGE3 if stage == 3 else {})
    results = run_distributed(train_parallel, world, case, backend="nccl")
    expected = train_reference(Case(lr=lr), world)
    for result in results:
        assert_matches_reference(result, expected, 1e-5 if dtype == "fp32" else 2e-2)


def test_lora_with_frozen_weights_partitioned_on_cuda():
    """LoRA at ZeRO-3 (tests/zero/test_frozen_stage3.py) on CUDA: frozen units gathered,
    freed after their input gradients, checkpoint-free run equal to plain torch."""
    from tests.zero.test_frozen_stage3 import STEPS as LORA_STEPS
    from tests.zero.test_frozen_stage3 import train_parallel as train_lora
    from tests.zero.test_frozen_stage3 import train_reference as lora_reference

    world = min(GPUS, 2)
    expected = lora_reference(world)
    for rank, result in enumerate(run_distributed(train_lora, world, 3, False, None, backend="nccl")):
        for step in range(LORA_STEPS):
            want = expected["losses"][step][rank]
            assert abs(result["losses"][step] - want) < 1e-5 * abs(want)
        for name, weight in expected["weights"].items():
            assert ((result["weights"][name] - weight).norm() / weight.norm()).item() < 1e-5, name


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_forward_only_reference_engine_on_cuda(dtype):
    """An engine without an optimizer beside a trained one (tests/zero/test_forward_only.py), ZeRO-3, on CUDA."""
    from tests.zero.test_forward_only import MICRO, STEPS as REFERENCE_STEPS, rlhf_parallel, rlhf_reference

    world = min(GPUS, 2)
    expected = rlhf_reference(world)
    for rank, result in enumerate(run_distributed(rlhf_parallel, world, 3, dtype, backend="nccl")):
        rows = torch.cat([expected["reference_logits"][s * MICRO * world + rank * MICRO:][:MICRO]
                          for s in range(REFERENCE_STEPS)])
        error = ((result["reference_logits"] - rows).norm() / rows.norm()).item()
        assert error < (1e-5 if dtype == "fp32" else 2e-2)
        assert len(result["refused"]) == 2 and result["optimizer"] is None
