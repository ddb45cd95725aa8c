"""fp16 with dynamic loss scaling on CUDA: training within fp16's precision of the fp32 CPU
reference, and an overflow (an injected inf) found on the device, the step skipped and the
scale halved (tests/runtime/precision/test_loss_scaler.py's worker). bf16 against the reference is
in test_cuda_engine.py."""

import pytest
import torch

from tests.gpu.ranks import train_cases
from tests.gpu.target import LR, WORLD, launch_once, needs_target, run_ranks
from tests.runtime.precision.test_loss_scaler import _train_fp16_with_overflow
from tests.runtime.zero.workers import Case, assert_matches_reference, train_reference

pytestmark = needs_target

# fp16 keeps 11 significant bits (unit roundoff 2^-11 ~ 5e-4), 4x finer than bf16, with
# the same sources of error (16-bit weights and activations, 3 Adam steps at lr 1e-3, see
# target.py's TOLERANCE); the scaled loss adds none while no step overflows. 1e-2 is twenty
# roundoffs.
TOLERANCE = 1e-2
# start at 2^8, not DeepSpeed's 2^16, so that no step of the comparison overflows and is skipped
SCALED = {"fp16": {"initial_scale_power": 8}}
STAGE3 = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}


@launch_once
def fp16_runs() -> list[list[dict]]:
    cases = [Case(stage=2, dtype="fp16", lr=LR, extra_config=SCALED),
             Case(stage=3, dtype="fp16", lr=LR, accumulation=2, extra_config={**SCALED, **STAGE3})]
    return run_ranks(train_cases, cases)


@pytest.mark.parametrize("index, stage", [(0, 2), (1, 3)], ids=["stage2", "stage3-accumulation2"])
def test_fp16_with_loss_scaling_matches_the_fp32_reference(index, stage):
    accumulation = 2 if stage == 3 else 1
    expected = train_reference(Case(lr=LR, accumulation=accumulation), WORLD)
    for runs in fp16_runs():
        assert_matches_reference(runs[index], expected, TOLERANCE)


@pytest.mark.parametrize("stage", [0, 2])
def test_an_overflow_skips_the_step_and_halves_the_scale(stage):
    """The last rank's loss becomes inf at step 2: its gradients overflow on the device, every
    rank skips that step (weights unchanged), the scale halves (hysteresis 1), and training
    resumes at step 3."""
    for result in run_ranks(_train_fp16_with_overflow, stage, 2, WORLD - 1):
        snapshots = result["snapshots"]
        assert result["skipped"] == 1
        assert torch.equal(snapshots[2], snapshots[1]), "the overflowing step changed weights"
        assert not torch.equal(snapshots[3], snapshots[2]), "training did not resume"
        assert torch.isfinite(snapshots[3]).all()
        assert result["scales"] == [256.0, 256.0, 128.0, 128.0]
