"""DeepSpeedExamples' HelloDeepSpeed shape (scripts/train_bert_ds.py) run unchanged by
`shardwise run --as-deepspeed`: a Hugging Face RoBERTa masked-LM (tied embedding and
output weights), optimizer offloaded to the CPU as in the original config, checkpoints
saved with `client_state` and resumed with `_, client_state = engine.load_checkpoint(dir)`;
the first run and the resumed one both equal the original's plain-PyTorch loop
(train_bert.py: torch.save / load_state_dict)."""

import pytest

from tests.frontends.deepspeed.api.scripts_harness import assert_losses_match, launch, run_plain

SCRIPT = "train_bert_ds.py"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    directory = tmp_path_factory.mktemp("bert_reference")
    run_plain(SCRIPT, "--checkpoint_dir", str(directory / "checkpoints"), "--loss-file", str(directory / "first"),
              cwd=directory)
    run_plain(SCRIPT, "--load_checkpoint_dir", str(directory / "checkpoints" / "bert_pretrain"),
              "--num_iterations", "9", "--loss-file", str(directory / "resumed"), cwd=directory)
    return directory


def train_and_resume(stage, tmp_path, *extra):
    checkpoints = tmp_path / "checkpoints"
    launch(SCRIPT, "--checkpoint_dir", str(checkpoints), "--zero_stage", str(stage), "--loss-file",
           str(tmp_path / "first"), *extra, cwd=tmp_path)
    launch(SCRIPT, "--load_checkpoint_dir", str(checkpoints / "bert_pretrain"), "--num_iterations", "9",
           "--zero_stage", str(stage), "--loss-file", str(tmp_path / "resumed"), *extra, cwd=tmp_path)
    return tmp_path


def check(run, reference):
    assert_losses_match(run / "first", reference / "first")
    assert_losses_match(run / "resumed", reference / "resumed")


def test_stage_1_offloaded_then_resumed_equals_plain_torch(tmp_path, reference):
    check(train_and_resume(1, tmp_path), reference)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_other_stages_equal_plain_torch(stage, tmp_path, reference):
    check(train_and_resume(stage, tmp_path, "--no-offload"), reference)
