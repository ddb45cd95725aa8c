"""DeepSpeedExamples' pipeline-parallelism script shape (scripts/pipeline_parallelism_train.py)
run unchanged by `shardwise run --as-deepspeed`: `deepspeed.pipe.PipelineModule` over a
flattened AlexNet (a lambda among the layers, activations changing shape between stages),
`deepspeed.initialize(training_data=...)` and `engine.train_batch()` with no iterator;
losses equal plain PyTorch on the same micro-batches, at pp=2 and at pp=2 x dp=2."""

import pytest

from tests.frontends.deepspeed.api.scripts_harness import SCRIPTS, assert_losses_match, launch, run_plain

SCRIPT = "pipeline_parallelism_train.py"
CONFIG = str(SCRIPTS / "pipeline_ds_config.json")


def run_both(tmp_path, world_size, *extra):
    run_plain(SCRIPT, "--deepspeed_config", CONFIG, "--world-size", str(world_size), "--loss-file",
              str(tmp_path / "plain"), *extra, cwd=tmp_path)
    launch(SCRIPT, "--deepspeed_config", CONFIG, "--loss-file", str(tmp_path / "run"), *extra, cwd=tmp_path,
           nproc=world_size)
    assert_losses_match(tmp_path / "run", tmp_path / "plain", world_size=world_size)


def test_two_stages_equal_plain_torch(tmp_path):
    run_both(tmp_path, 2)


@pytest.mark.slow
def test_two_stages_by_type_times_two_data_ranks_equal_plain_torch(tmp_path):
    run_both(tmp_path, 4, "--partition", "type:linear")


@pytest.mark.slow  # a variant: the pipeline's equivalence runs by default at pp=2 (above)
def test_one_stage_trains_as_data_parallel_equal_plain_torch(tmp_path):
    """num_stages=1: DeepSpeed still trains a PipelineModule with train_batch(); here that
    is gradient accumulation over the same micro-batches on 2 data-parallel ranks."""
    run_both(tmp_path, 2, "--pipeline-parallel-size", "1")
