"""Resuming from a checkpoint continues the run exactly (same layout) or within docs/development.md#how-shardwise-is-tested
tolerances (another world size or ZeRO stage), optimizer state included (issue 4, C8)."""

from functools import lru_cache

import pytest

from shardwise.tools.testing import run_distributed
from tests.runtime.checkpoint.workers import KEEP_SMALL_WHOLE, PARTITION_EVERYTHING, Run, train_run
from tests.runtime.zero.workers import Case, relative_error, train_reference

TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2}
LR = {"fp32": 1e-2, "bf16": 1e-3}
ROWS = 8
HYBRID = {"zero_optimization": {"mics_shard_size": 2}}
WARMUP = {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_type": "linear"}}}


@lru_cache(maxsize=None)
def reference(lr: float) -> dict:
    """One process, fp32, three steps on the same global batches (more steps let Adam
    amplify summation-order noise past the fp32 tolerance, resumed or not)."""
    return train_reference(Case(steps=3, micro_batch=ROWS, lr=lr), world_size=1)


@pytest.mark.parametrize("stage, dtype", [(0, "fp32"), (1, "fp32"), (2, "fp32"), (3, "fp32"), (3, "bf16"), (2, "fp16")])
def test_resume_at_same_layout_is_bit_identical(stage, dtype, tmp_path):
    case = Case(stage=stage, dtype=dtype, extra_config={**KEEP_SMALL_WHOLE, **WARMUP})
    client_state = {"epoch": 3, "sampler": {"seen": [1, 2, 3]}, "note": "resume"}
    uninterrupted = run_distributed(
        train_run, 2, Run(case, steps=4, save_dir=str(tmp_path), save_after=2, client_state=client_state)
    )
    resumed = run_distributed(train_run, 2, Run(case, first_step=2, load_dir=str(tmp_path)))

    assert resumed[0]["losses"] == uninterrupted[0]["losses"][2:]
    for name, tensor in uninterrupted[0]["params"].items():
        assert resumed[0]["params"][name].equal(tensor), name
    for rank in range(2):
        assert resumed[rank]["client_state"] == client_state
        assert resumed[rank]["global_steps"] == 4
        assert resumed[rank]["lr"] == uninterrupted[rank]["lr"]
        if dtype == "fp16":  # dynamic loss scaling: its counters must carry over too
            assert resumed[rank]["loss_scaler"] == uninterrupted[rank]["loss_scaler"]
        assert resumed[rank]["draws_after_load"] == uninterrupted[rank]["draws_after_save"]
    assert resumed[0]["draws_after_load"] != resumed[1]["draws_after_load"]  # each rank its own


@pytest.mark.parametrize(
    "dtype, before, after",
    [
        ("fp32", (2, 2, PARTITION_EVERYTHING), (4, 3, PARTITION_EVERYTHING)),
        ("fp32", (4, 3, KEEP_SMALL_WHOLE), (1, 0, {})),
        ("fp32", (1, 1, {}), (2, 2, {})),
        ("fp32", (2, 0, {}), (2, 3, PARTITION_EVERYTHING)),
        ("bf16", (4, 3, PARTITION_EVERYTHING), (2, 1, {})),
        ("fp32", (4, 3, {"zero_optimization": {"stage3_param_persistence_threshold": 0, "mics_shard_size": 2}}),
         (2, 3, PARTITION_EVERYTHING)),
        ("fp32", (4, 1, HYBRID), (2, 2, {})),
    ],
    ids=["2r-s2-to-4r-s3", "4r-s3-to-1r-s0", "1r-s1-to-2r-s2", "2r-s0-to-2r-s3", "bf16-4r-s3-to-2r-s1",
         "hybrid-4r-s3-to-2r-s3", "hybrid-4r-s1-to-2r-s2"],
)
def test_resume_at_another_world_size_and_stage(dtype, before, after, tmp_path):
    (world_before, stage_before, extra_before), (world_after, stage_after, extra_after) = before, after
    lr = LR[dtype]
    saved = run_distributed(
        train_run, world_before,
        Run(Case(stage=stage_before, dtype=dtype, lr=lr, extra_config=extra_before), rows=ROWS, steps=1,
            save_dir=str(tmp_path)),
    )[0]
    resumed = run_distributed(
        train_run, world_after,
        Run(Case(stage=stage_after, dtype=dtype, lr=lr, extra_config=extra_after), rows=ROWS, first_step=1,
            load_dir=str(tmp_path)),
    )[0]

    expected = reference(lr)
    for step, got in enumerate(saved["losses"] + resumed["losses"]):
        want = expected["losses"][step]
        assert abs(got - want) / want < TOLERANCE[dtype], f"step {step}: {got} vs reference {want}"
    for name, want in expected["params"].items():
        error = relative_error(resumed["params"][name], want)
        assert error < TOLERANCE[dtype], f"{name}: relative error {error:.2e}"


@pytest.mark.parametrize(
    "stage, before, after",
    [(0, (2, 1), (1, 2)), (1, (2, 1), (1, 2)), (2, (2, 1), (1, 2)), (3, (2, 1), (1, 2)), (2, (1, 2), (2, 1))],
    ids=["s0-2r-acc1-to-1r-acc2", "s1-2r-acc1-to-1r-acc2", "s2-2r-acc1-to-1r-acc2", "s3-2r-acc1-to-1r-acc2",
         "s2-1r-acc2-to-2r-acc1"],
)
def test_resume_with_another_accumulation_continues_the_run(stage, before, after, tmp_path):
    """The same global batch at another world size changes gradient_accumulation_steps;
    the first update after the resume must still see a whole window."""
    (world_before, accumulation_before), (world_after, accumulation_after) = before, after
    saved = run_distributed(
        train_run, world_before,
        Run(Case(stage=stage, accumulation=accumulation_before), rows=ROWS, steps=1, save_dir=str(tmp_path)),
    )[0]
    resumed = run_distributed(
        train_run, world_after,
        Run(Case(stage=stage, accumulation=accumulation_after), rows=ROWS, first_step=1, load_dir=str(tmp_path)),
    )[0]
    expected = reference(LR["fp32"])
    assert len(saved["losses"] + resumed["losses"]) == 3 and resumed["global_steps"] == 3
    for step, got in enumerate(saved["losses"] + resumed["losses"]):
        want = expected["losses"][step]
        assert abs(got - want) / want < TOLERANCE["fp32"], f"step {step}: {got} vs reference {want}"
    for name, want in expected["params"].items():
        error = relative_error(resumed["params"][name], want)
        assert error < TOLERANCE["fp32"], f"{name}: relative error {error:.2e}"
