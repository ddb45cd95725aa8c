"""DeepSpeed-Chat step-1 shape (scripts/dschat_step1_sft.py) run unchanged by
`shardwise run --as-deepspeed`: `from deepspeed.ops.adam import FusedAdam` over
weight-decay param groups, Hugging Face's cosine schedule passed in, the config built in
code (hybrid_engine, tensorboard blocks...), HF gradient checkpointing switched on
through the engine (`engine.gradient_checkpointing_enable()`), `engine.model` and
`engine.tput_timer` read as the script does; losses equal plain PyTorch."""

import pytest

from tests.frontends.deepspeed.api.scripts_harness import assert_losses_match, launch, run_plain

SCRIPT = "dschat_step1_sft.py"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    directory = tmp_path_factory.mktemp("dschat_reference")
    run_plain(SCRIPT, "--gradient_checkpointing", "--gradient_accumulation_steps", "2", "--loss-file",
              str(directory / "plain"), cwd=directory)
    return directory / "plain"


def run_at(stage, tmp_path):
    launch(SCRIPT, "--zero_stage", str(stage), "--gradient_checkpointing", "--gradient_accumulation_steps", "2",
           "--loss-file", str(tmp_path / "run"), cwd=tmp_path)
    return tmp_path / "run"


def test_stage_3_with_checkpointing_and_accumulation_equals_plain_torch(tmp_path, reference):
    assert_losses_match(run_at(3, tmp_path), reference)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_other_stages_equal_plain_torch(stage, tmp_path, reference):
    assert_losses_match(run_at(stage, tmp_path), reference)
