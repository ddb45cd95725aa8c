"""GPU checks (SPEC §6): skipped without CUDA; run them whenever a GPU machine is lent
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
