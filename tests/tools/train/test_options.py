"""How the main job's config is assembled: defaults, a user's DeepSpeed file, then flags."""

import pytest

from shardwise.frontends.deepspeed.config import load_config
from shardwise.models import GPTConfig
from shardwise.tools.train.options import (
    MODEL_SIZES,
    TrainOptions,
    apply_flags,
    default_config,
    dtype_name,
    merge_config,
)


def test_model_sizes_are_the_gpt_presets():
    for size in MODEL_SIZES:
        GPTConfig.preset(size)
    with pytest.raises(ValueError):
        GPTConfig.preset("not-a-size")


def test_default_config_resolves_for_the_10m_model_on_two_ranks():
    cfg = load_config(apply_flags(default_config(200), None, False, 7), world_size=2, hidden_size=384)
    assert cfg.zero_optimization.stage == 3
    assert cfg.train_micro_batch_size_per_gpu == 4 and cfg.gradient_accumulation_steps == 1
    assert cfg.zero_optimization.reduce_bucket_size == 384 * 384
    assert cfg.zero_optimization.stage3_param_persistence_threshold == 3840
    assert cfg.zero_optimization.stage3_max_reuse_distance == 0
    assert cfg.scheduler.params["total_num_steps"] == 200
    assert cfg.seed == 7


def test_user_sections_merge_but_blocks_and_batch_keys_replace():
    user = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 1},
    }
    merged = merge_config(default_config(10), user)
    assert "train_batch_size" not in merged
    assert merged["train_micro_batch_size_per_gpu"] == 2
    assert merged["optimizer"] == {"type": "SGD", "params": {"lr": 0.1}}
    assert merged["zero_optimization"]["stage"] == 1
    assert merged["zero_optimization"]["reduce_bucket_size"] == "auto"
    assert merged["scheduler"]["type"] == "WarmupCosineLR"


def test_flags_win_over_the_config():
    config = merge_config(default_config(10), {"zero_optimization": {"stage": 1}, "seed": 3})
    flagged = apply_flags(config, stage=2, bf16=True, seed=5)
    assert flagged["zero_optimization"]["stage"] == 2
    assert flagged["bf16"] == {"enabled": True}
    assert flagged["seed"] == 5
    assert dtype_name(flagged) == "bf16"
    assert dtype_name(apply_flags(config, None, False, 5)) == "fp32"
    assert config["zero_optimization"]["stage"] == 1  # not modified in place


def test_options_round_trip_through_json(tmp_path):
    options = TrainOptions(run_dir=str(tmp_path), corpus_path="c.bin", config=default_config(4), steps=4, profile=True)
    options.save(tmp_path / "options.json")
    assert TrainOptions.load(tmp_path / "options.json") == options
