"""DeepSpeed-Chat step 3's reference model (scripts/dschat_step3_reference.py) run
unchanged by `shardwise run --as-deepspeed`: a second engine built without an optimizer
from `get_eval_ds_config` runs forward only beside the training actor (ZeRO-3 when the
actor uses it, stage 0 otherwise); the actor's KL-penalised losses equal plain PyTorch."""

import pytest

from tests.frontends.deepspeed.api.scripts_harness import assert_losses_match, launch, run_plain

SCRIPT = "dschat_step3_reference.py"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    directory = tmp_path_factory.mktemp("dschat_step3_reference")
    run_plain(SCRIPT, "--loss-file", str(directory / "plain"), cwd=directory)
    return directory / "plain"


def run_at(stage, tmp_path):
    launch(SCRIPT, "--actor_zero_stage", str(stage), "--loss-file", str(tmp_path / "run"), cwd=tmp_path)
    return tmp_path / "run"


def test_stage_3_actor_with_a_partitioned_reference_equals_plain_torch(tmp_path, reference):
    assert_losses_match(run_at(3, tmp_path), reference)


@pytest.mark.slow
def test_stage_2_actor_with_a_stage_0_reference_equals_plain_torch(tmp_path, reference):
    assert_losses_match(run_at(2, tmp_path), reference)
