"""ShardwiseTrainer resumes a `checkpoint-N` folder whose engine state is in DeepSpeed's layout
(`latest` and `global_stepN/` as DeepSpeed writes them beside the Trainer's own files), as a
user switching from the DeepSpeed-backed Trainer has: the losses continue as the reference's.

The DeepSpeed files here are the run's own checkpoint written by `convert --to-deepspeed`
(which DeepSpeed 0.19.8 itself resumes exactly: tests/frontends/deepspeed/checkpoints/)."""

from __future__ import annotations

import shutil

from shardwise.frontends.deepspeed.checkpoints.to_deepspeed import write_deepspeed_checkpoint
from tests.frontends.hf_trainer.test_hf_trainer import STEPS, assert_logs_match, runs  # noqa: F401  (fixture)
from tests.frontends.hf_trainer.workers import train_shardwise


def test_resumes_a_checkpoint_folder_in_deepspeeds_layout(runs, tmp_path):  # noqa: F811
    runs.shardwise(2)
    own = runs.root / "stage2" / "checkpoint-2"
    folder = tmp_path / "checkpoint-2"
    shutil.copytree(own, folder, ignore=shutil.ignore_patterns("global_step*", "latest"))
    write_deepspeed_checkpoint(own, folder, world_size=2, stage=2)
    assert (folder / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").is_file()
    assert not (folder / "global_step2" / "manifest.json").exists()
    resumed = runs.get("resume_from_deepspeed", train_shardwise, 2, stage=2, resume=str(folder))
    for result in resumed:
        assert_logs_match(result, runs.reference(), STEPS[2:])
