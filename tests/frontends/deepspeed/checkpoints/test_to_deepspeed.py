"""The way back: a shardwise checkpoint written as DeepSpeed's ZeRO-1/2 folder (`shardwise
convert --to-deepspeed`) continues as shardwise's own checkpoint does, read back by shardwise
here and, with DEEPSPEED_PYTHON set, by DeepSpeed 0.19.8 itself."""

import json
import os
import subprocess

import pytest

from shardwise.tools.cli.main import main as cli
from shardwise.tools.testing import run_distributed
from tests.frontends.deepspeed.checkpoints.fixtures import make_fixtures
from tests.frontends.deepspeed.checkpoints.test_resume import FP32_TOLERANCE, assert_losses_equal
from tests.frontends.deepspeed.checkpoints.workers import FIXTURES, resume, save_for_deepspeed

CASE = "stage2_fp32"


@pytest.fixture(scope="module")
def shardwise_checkpoint(tmp_path_factory):
    """A shardwise checkpoint after step 6: DeepSpeed's step-3 fixture resumed and trained 3 steps."""
    directory = tmp_path_factory.mktemp("shardwise")
    run_distributed(resume, 2, CASE, str(FIXTURES / CASE / "checkpoint"), save_to=str(directory), timeout=240)
    continued = run_distributed(resume, 2, CASE, str(directory), timeout=240)[0]
    assert continued["global_steps"] == 6
    return directory, continued["losses"]


def test_to_deepspeed_reads_back_and_continues_the_same(shardwise_checkpoint, tmp_path, capsys):
    directory, expected = shardwise_checkpoint
    assert cli(["convert", "--to-deepspeed", "--world-size", "2", str(directory), str(tmp_path)]) == 0
    assert "DeepSpeed's ZeRO-2 layout for 2 ranks" in capsys.readouterr().out
    assert sorted(path.name for path in (tmp_path / "resumed").iterdir()) == [
        "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    back = run_distributed(resume, 2, CASE, str(tmp_path), timeout=240)[0]
    assert back["global_steps"] == 6
    assert_losses_equal(back["losses"], expected, FP32_TOLERANCE)


def test_engine_saves_in_deepspeeds_layout(shardwise_checkpoint, tmp_path):
    """`engine.save_deepspeed_checkpoint` mid-run: reading it back continues as the run did."""
    _, expected = shardwise_checkpoint
    saved = run_distributed(save_for_deepspeed, 2, CASE, str(FIXTURES / CASE / "checkpoint"), str(tmp_path),
                            timeout=240)[0]
    assert saved["written"] == str(tmp_path / "global_step6")
    assert not (tmp_path / ".shardwise-for-deepspeed").exists()
    assert_losses_equal(saved["losses"], expected, FP32_TOLERANCE)
    back = run_distributed(resume, 2, CASE, str(tmp_path), timeout=240)[0]
    assert back["client_state"] == {"note": "back"}
    assert_losses_equal(back["losses"], expected, FP32_TOLERANCE)


def test_to_deepspeed_needs_the_world_size(shardwise_checkpoint, tmp_path, capsys):
    directory, _ = shardwise_checkpoint
    assert cli(["convert", "--to-deepspeed", str(directory), str(tmp_path)]) == 2
    assert "--world-size" in capsys.readouterr().err


@pytest.mark.skipif(not os.environ.get("DEEPSPEED_PYTHON"), reason="set DEEPSPEED_PYTHON to an interpreter with "
                    "DeepSpeed 0.19.8 installed (DS_ACCELERATOR=cpu is set for it)")
def test_deepspeed_resumes_the_converted_checkpoint_exactly(shardwise_checkpoint, tmp_path):
    directory, expected = shardwise_checkpoint
    assert cli(["convert", "--to-deepspeed", "--world-size", "2", str(directory), str(tmp_path / "ds")]) == 0
    out = tmp_path / "deepspeed.json"
    done = subprocess.run([os.environ["DEEPSPEED_PYTHON"], make_fixtures.__file__, "resume", CASE,
                           str(tmp_path / "ds"), str(out)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    theirs = json.loads(out.read_text())
    assert theirs["global_steps_loaded"] == 6
    assert_losses_equal(theirs["resumed"], expected, FP32_TOLERANCE)
