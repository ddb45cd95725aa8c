"""`auto_resume` (elastic jobs, docs/launching.md#elastic-training): the global batch is
kept when a config written for one world size is loaded at another."""

import pytest

from shardwise.frontends.deepspeed.config import ConfigError, load_config
from shardwise.frontends.deepspeed.config.policies import policies_from_config

WRITTEN_FOR_4 = {"train_batch_size": 12, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 3}


def batch(cfg):
    return cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps


def test_another_world_size_derives_accumulation_again_and_keeps_the_global_batch():
    resume = {"auto_resume": {"checkpoint_dir": "ckpt"}}
    assert batch(load_config({**WRITTEN_FOR_4, **resume}, world_size=4)) == (12, 1, 3)
    assert batch(load_config({**WRITTEN_FOR_4, **resume}, world_size=3)) == (12, 1, 4)
    assert batch(load_config({**WRITTEN_FOR_4, **resume}, world_size=2)) == (12, 1, 6)
    assert policies_from_config(load_config({**WRITTEN_FOR_4, **resume}, world_size=3)).checkpoint.resume_from == "ckpt"


def test_without_auto_resume_the_three_keys_must_still_multiply_out():
    with pytest.raises(ConfigError, match=r"train_batch_size 12 != .* world_size 3"):
        load_config(WRITTEN_FOR_4, world_size=3)


def test_the_micro_batch_changes_only_where_allowed():
    config = {"train_batch_size": 12, "train_micro_batch_size_per_gpu": 4}
    with pytest.raises(ConfigError, match="train_batch_size 12 is not divisible by train_micro_batch_size_per_gpu 4"):
        load_config({**config, "auto_resume": {"checkpoint_dir": "ckpt"}}, world_size=2)
    adjusted = load_config({**config, "auto_resume": {"checkpoint_dir": "ckpt", "adjust_micro_batch": True}},
                           world_size=2)
    assert batch(adjusted) == (12, 3, 2)
    with pytest.raises(ConfigError, match="train_batch_size 12 is not divisible"):  # no micro-batch fits 12 on 5
        load_config({**config, "auto_resume": {"checkpoint_dir": "ckpt", "adjust_micro_batch": True}}, world_size=5)


def test_no_folder_means_no_resume():
    assert policies_from_config(load_config(WRITTEN_FOR_4, world_size=4)).checkpoint.resume_from is None
