"""DeepSpeed's own checkpoints (fixtures/, written by DeepSpeed 0.19.8 on 2 CPU ranks after 3
steps) resumed by shardwise: the next 3 losses equal DeepSpeed's continuation from the same
files (fp32: < 1e-6 relative; bf16: < 2e-2), at another stage or world size equal to
shardwise resuming the same checkpoint converted to its own format, and `shardwise convert
--from-deepspeed` writes a checkpoint that resumes the same way."""

import json
import os
import subprocess

import pytest

from shardwise.tools.cli.main import main as cli
from shardwise.tools.testing import run_distributed
from tests.frontends.deepspeed.checkpoints.fixtures import make_fixtures
from tests.frontends.deepspeed.checkpoints.workers import FIXTURES, fixture_losses, resume

FP32_TOLERANCE, BF16_TOLERANCE = 1e-6, 2e-2
FP16_TOLERANCE = 1e-3  # measured 5e-5 here; fp16 keeps 11 significant bits to bf16's 8
QUICK = {"stage2_fp32", "stage3_bf16", "pipeline_fp32", "universal", "fp16_dynamic"}  # each layout and precision once
CASES = [pytest.param(case, marks=() if case in QUICK else pytest.mark.slow) for case in make_fixtures.CASES]


def assert_losses_equal(got: list[list[float]], want: list[list[float]], tolerance: float) -> None:
    assert len(got) == len(want)
    for step, (ours, theirs) in enumerate(zip(got, want)):
        for rank, (a, b) in enumerate(zip(ours, theirs)):
            assert abs(a - b) <= tolerance * abs(b), f"step {step} rank {rank}: {a} vs DeepSpeed's {b}\n{got}\n{want}"


@pytest.mark.parametrize("case", CASES)
def test_resumes_deepspeeds_checkpoint_as_deepspeed_does(case):
    _, precision, _ = make_fixtures.CASES[case]
    results = run_distributed(resume, 2, case, str(FIXTURES / case / "checkpoint"), timeout=240)
    recorded = fixture_losses(case)
    tolerance = {"fp32": FP32_TOLERANCE, "fp16": FP16_TOLERANCE, "bf16": BF16_TOLERANCE}[precision]
    assert_losses_equal(results[0]["losses"], recorded["deepspeed_resumed"], tolerance)
    assert recorded["deepspeed_resumed"] == recorded["uninterrupted"][3:]  # DeepSpeed's own resume is exact
    assert results[0]["global_steps"] == 3
    assert results[0]["client_state"] == {"note": "fixture", "epoch": 1}
    # WarmupLR continued, not restarted: its iteration after 3 steps is 2, less the steps skipped on overflow
    warmup, skipped = make_fixtures.tiny.SCHEDULER["params"], results[0]["skipped_steps"]
    assert results[0]["lr"] == pytest.approx([warmup["warmup_max_lr"] * (2 - skipped) / warmup["warmup_num_steps"]] * 2)
    if precision == "fp16":  # DeepSpeed's dynamic loss scaler as it was: one overflow (step 3, skipped)
        assert skipped == 1
        assert results[0]["loss_scaler"] == {"scale": 2.0**17, "remaining_hysteresis": 1, "iteration": 3,
                                             "last_overflow_iteration": 2}
    else:
        assert skipped == 0


def test_convert_from_deepspeed_resumes_the_same(tmp_path, capsys):
    assert cli(["convert", "--from-deepspeed", str(FIXTURES / "stage3_fp32" / "checkpoint"), str(tmp_path)]) == 0
    assert "wrote" in capsys.readouterr().out
    assert (tmp_path / "latest").read_text().strip() == "step3"
    assert (tmp_path / "step3" / "manifest.json").is_file()
    results = run_distributed(resume, 2, "stage3_fp32", str(tmp_path), timeout=240)
    assert_losses_equal(results[0]["losses"], fixture_losses("stage3_fp32")["deepspeed_resumed"], FP32_TOLERANCE)


@pytest.mark.parametrize("stage, world_size", [(3, 2), (1, 1)], ids=["stage3-2ranks", "stage1-1rank"])
def test_resharded_resume_equals_resuming_the_converted_checkpoint(tmp_path, stage, world_size):
    """The ZeRO-2 checkpoint of 2 ranks resumed at another stage or world size, straight from
    DeepSpeed's files, continues as shardwise's own (converted) checkpoint does there."""
    source = FIXTURES / "stage2_fp32" / "checkpoint"
    assert cli(["convert", "--from-deepspeed", str(source), str(tmp_path)]) == 0
    direct = run_distributed(resume, world_size, "stage2_fp32", str(source), stage=stage, timeout=240)[0]
    converted = run_distributed(resume, world_size, "stage2_fp32", str(tmp_path), stage=stage, timeout=240)[0]
    assert direct["losses"] == converted["losses"]
    if world_size == 2:  # the same global batch as DeepSpeed's run: its continuation too
        assert_losses_equal(direct["losses"], fixture_losses("stage2_fp32")["deepspeed_resumed"], 1e-5)


def test_convert_refuses_a_folder_that_is_not_deepspeeds(tmp_path, capsys):
    (tmp_path / "latest").write_text("step3")
    (tmp_path / "step3").mkdir()
    assert cli(["convert", "--from-deepspeed", str(tmp_path), str(tmp_path / "out")]) == 2
    assert "is not a DeepSpeed checkpoint" in capsys.readouterr().err


@pytest.mark.skipif(not os.environ.get("DEEPSPEED_PYTHON"), reason="set DEEPSPEED_PYTHON to an interpreter with "
                    "DeepSpeed 0.19.8 installed (DS_ACCELERATOR=cpu is set for it)")
def test_resumes_a_fresh_deepspeed_checkpoint(tmp_path):
    """The fixtures' script run again by the installed DeepSpeed (ZeRO-3, fp32): the checkpoint
    it writes now resumes as DeepSpeed's own continuation of it."""
    done = subprocess.run([os.environ["DEEPSPEED_PYTHON"], make_fixtures.__file__, "write", str(tmp_path),
                           "--case", "stage3_fp32"], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    recorded = json.loads((tmp_path / "stage3_fp32" / "losses.json").read_text())
    results = run_distributed(resume, 2, "stage3_fp32", str(tmp_path / "stage3_fp32" / "checkpoint"), timeout=240)
    assert_losses_equal(results[0]["losses"], recorded["deepspeed_resumed"], FP32_TOLERANCE)
