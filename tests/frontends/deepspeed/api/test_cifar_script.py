"""DeepSpeedExamples' CIFAR script shape (scripts/cifar10_deepspeed.py) run unchanged by
`shardwise run --as-deepspeed`: the config's Adam and WarmupLR, model_parameters as a
filter, training_data turned into the engine's distributed loader; losses equal plain
PyTorch on the same global batches."""

import pytest

from tests.frontends.deepspeed.api.scripts_harness import BF16_TOLERANCE, assert_losses_match, launch, run_plain

SCRIPT = "cifar10_deepspeed.py"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    directory = tmp_path_factory.mktemp("cifar_reference")
    run_plain(SCRIPT, "--loss-file", str(directory / "plain"), cwd=directory)
    return directory / "plain"


def run_at(stage, tmp_path, *extra):
    launch(SCRIPT, "--stage", str(stage), "--loss-file", str(tmp_path / "run"), *extra, cwd=tmp_path)
    return tmp_path / "run"


def test_stage_2_equals_plain_torch(tmp_path, reference):
    assert_losses_match(run_at(2, tmp_path), reference)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 3])
def test_other_stages_equal_plain_torch(stage, tmp_path, reference):
    assert_losses_match(run_at(stage, tmp_path), reference)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_16_bit_within_16_bit_tolerance(dtype, tmp_path, reference):
    assert_losses_match(run_at(3, tmp_path, "--dtype", dtype), reference, tolerance=BF16_TOLERANCE)


def test_moe_layers_with_expert_param_groups_equal_plain_torch(tmp_path):
    """The script's `--moe` path as DeepSpeedExamples runs it (expert param groups, two MoE
    layers of 2 experts sharing one residual MLP), with every expert on every rank; a
    capacity of every token on the rank, so Random Token Selection drops none."""
    extra = ("--moe", "--moe-param-group", "--num-experts", "2", "2", "--mlp-type", "residual", "--min-capacity", "4")
    run_plain(SCRIPT, "--loss-file", str(tmp_path / "plain"), *extra, cwd=tmp_path)
    assert_losses_match(run_at(2, tmp_path, *extra), tmp_path / "plain")
