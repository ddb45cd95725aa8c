"""What the shardwise TRL trainers refuse before training, and the release check."""

from __future__ import annotations

import pytest

pytest.importorskip("trl", reason="the TRL trainers need the trl extra: pip install 'shardwise[trl]'")

from shardwise.frontends.trl.versions import check_versions  # noqa: E402


def test_release_outside_the_tested_range_is_refused_with_what_to_install():
    check_versions({"trl": "1.16.0"})
    with pytest.raises(ImportError, match=r"trl 1\.15\.2 is installed.*pip install 'shardwise\[trl\]'"):
        check_versions({"trl": "1.15.2"})
    with pytest.raises(ImportError, match="trl is not installed"):
        check_versions({"trl": None})


def test_factory_takes_trainer_subclasses_once_each():
    from transformers import Trainer
    from trl import DPOTrainer, SFTTrainer

    from shardwise.frontends.hf_trainer.trainer import ShardwiseTrainer
    from shardwise.frontends.trl.trainers import shardwise_trainer

    made = shardwise_trainer(SFTTrainer)
    assert made is shardwise_trainer(SFTTrainer) and made.__name__ == "ShardwiseSFTTrainer"
    assert made.__mro__[1:4] == (made.__mro__[1], ShardwiseTrainer, SFTTrainer)
    assert issubclass(shardwise_trainer(DPOTrainer), DPOTrainer) and issubclass(shardwise_trainer(Trainer), Trainer)
    with pytest.raises(TypeError, match="expects a transformers.Trainer subclass"):
        shardwise_trainer(dict)
    with pytest.raises(TypeError, match="already trains through shardwise"):
        shardwise_trainer(made)


def test_sync_ref_model_is_refused_before_anything_is_built(tmp_path):
    from trl import DPOConfig, DPOTrainer

    from shardwise.frontends.trl.trainers import shardwise_trainer

    args = DPOConfig(output_dir=str(tmp_path), sync_ref_model=True, report_to="none", bf16=False)
    with pytest.raises(ValueError, match="sync_ref_model=True is not supported.*sync_ref_model=False"):
        shardwise_trainer(DPOTrainer)(model=None, ref_model=None, args=args, shardwise_config={})


def test_grpo_generation_settings_that_cannot_work_are_refused_before_anything_is_built(tmp_path):
    from trl import GRPOConfig, GRPOTrainer

    from shardwise.frontends.trl.trainers import shardwise_trainer

    def args(**extra):
        return GRPOConfig(output_dir=str(tmp_path), report_to="none", bf16=False, **extra)

    trainer = shardwise_trainer(GRPOTrainer)
    with pytest.raises(ValueError, match="use_vllm=True is not supported.*use_vllm=False"):
        trainer(model=None, args=args(use_vllm=True), shardwise_config={})
    with pytest.raises(ValueError, match="ds3_gather_for_generation=False is not supported.*each rank stops"):
        trainer(model=None, args=args(ds3_gather_for_generation=False),
                shardwise_config={"zero_optimization": {"stage": 3}})
