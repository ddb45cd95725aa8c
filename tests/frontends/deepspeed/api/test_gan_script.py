"""DeepSpeedExamples' GAN shape (scripts/gan_deepspeed_train.py) run unchanged by
`shardwise run --as-deepspeed`: two engines from one `args` (config from
--deepspeed_config, whose optimizer block the passed optimizers override), the
discriminator's loss back-propagated twice before its step, the generator's loss
flowing through the discriminator's parameters, `module.zero_grad()` between updates;
losses equal the original's plain-PyTorch loop (gan_baseline_train.py)."""

import json

import pytest

from tests.frontends.deepspeed.api.scripts_harness import SCRIPTS, assert_losses_match, launch, run_plain

SCRIPT = "gan_deepspeed_train.py"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gan_reference")
    run_plain(SCRIPT, "--loss-file", str(directory / "plain"), cwd=directory)
    return directory / "plain"


def run_at(stage, tmp_path):
    config = json.loads((SCRIPTS / "gan_deepspeed_config.json").read_text())
    config["zero_optimization"] = {"stage": stage}
    config["gradient_clipping"] = 0.0  # no clipping, as the reference; DeepSpeed 0.19.8 clips at 1.0 without the key
    (tmp_path / "ds_config.json").write_text(json.dumps(config))
    launch(SCRIPT, "--deepspeed_config", str(tmp_path / "ds_config.json"), "--loss-file", str(tmp_path / "run"),
           cwd=tmp_path)
    return tmp_path / "run"


def test_stage_0_equals_plain_torch(tmp_path, reference):
    assert_losses_match(run_at(0, tmp_path), reference)


def test_stage_3_equals_plain_torch(tmp_path, reference):
    assert_losses_match(run_at(3, tmp_path), reference)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
def test_other_stages_equal_plain_torch(stage, tmp_path, reference):
    assert_losses_match(run_at(stage, tmp_path), reference)
