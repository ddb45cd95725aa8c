"""ShardwiseTrainer's checks before training: supported releases, the config against
TrainingArguments (Hugging Face's fill-or-must-match rules), and the misuses it refuses
with a message naming the key or argument and the fix."""

from __future__ import annotations

import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from shardwise.frontends.deepspeed.config import ConfigError, load_config
from shardwise.frontends.hf_trainer.trainer_config import (
    auto_values,
    check_config,
    complete_batch_keys,
    read_config,
    trainer_values,
)
from shardwise.frontends.hf_trainer.versions import SUPPORTED, check_versions
from shardwise.tools.testing import run_distributed
from tests.frontends.hf_trainer.workers import CONFIG_BLOCKS, hf_style_config, refusals, train_from_deepspeed_argument

ROOT = Path(__file__).resolve().parents[3]


def training_arguments(**overrides) -> SimpleNamespace:
    """The TrainingArguments fields the config is filled from (defaults as transformers')."""
    fields = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, world_size=8, max_grad_norm=1.0,
                  learning_rate=5e-5, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, weight_decay=0.0,
                  fp16=False, fp16_full_eval=False, bf16=True, bf16_full_eval=False, warmup_steps=0.1)
    fields.update(overrides)
    args = SimpleNamespace(**fields)
    args.get_warmup_steps = lambda total: int(args.warmup_steps) if args.warmup_steps >= 1 else -(-total * 0.1 // 1)
    return args


def test_installed_releases_are_supported():
    check_versions()


@pytest.mark.parametrize("installed, says", [
    ({"transformers": "4.57.1", "accelerate": "1.15.0"}, "transformers 4.57.1 is installed; ShardwiseTrainer supports"),
    ({"transformers": "5.23.0", "accelerate": None}, "accelerate is not installed"),
])
def test_unsupported_release_fails_with_what_to_install(installed, says):
    with pytest.raises(ImportError) as raised:
        check_versions(installed)
    assert says in str(raised.value)
    assert f"pip install 'transformers{SUPPORTED['transformers']}'" in str(raised.value)


def test_pyproject_pins_the_supported_releases():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra in ("transformers", "dev"):
        assert {f"{package}{wanted}" for package, wanted in SUPPORTED.items()} <= set(extras[extra]), extra


def test_hf_template_fills_every_auto_from_the_arguments():
    config = complete_batch_keys({**hf_style_config(3), **CONFIG_BLOCKS})
    values = trainer_values(training_arguments(), num_training_steps=100)
    check_config(config, values)
    cfg = load_config(config, world_size=8, hidden_size=64, auto_values=auto_values(values))
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (64, 4, 2)
    assert cfg.gradient_clipping == 1.0 and cfg.bf16.enabled and not cfg.fp16.enabled
    assert cfg.optimizer.params["lr"] == 5e-5 and list(cfg.optimizer.params["betas"]) == [0.9, 0.999]
    assert cfg.scheduler.params["total_num_steps"] == 100 and cfg.scheduler.params["warmup_num_steps"] == 10
    zero = cfg.zero_optimization
    assert (zero.reduce_bucket_size, zero.stage3_prefetch_bucket_size, zero.stage3_param_persistence_threshold) == (
        64 * 64, int(0.9 * 64 * 64), 640)
    assert zero.stage3_gather_16bit_weights_on_model_save


def test_left_out_batch_keys_take_the_trainers_values():
    config = complete_batch_keys({"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {}}})
    values = trainer_values(training_arguments(bf16=False))
    cfg = load_config(config, world_size=8, auto_values=auto_values(values))
    assert (cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (4, 2)


def test_numbers_that_disagree_with_the_arguments_are_listed():
    config = {"gradient_accumulation_steps": 4, "gradient_clipping": 1.0, "train_micro_batch_size_per_gpu": "auto",
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": (0.9, 0.999)}},
              "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 50}},
              "bf16": {"enabled": False}}
    with pytest.raises(ConfigError) as raised:
        check_config(config, trainer_values(training_arguments(), num_training_steps=100))
    problems = raised.value.problems
    assert len(problems) == 4, problems
    assert problems[0].startswith("gradient_accumulation_steps: the config says 4 but "
                                  "TrainingArguments.gradient_accumulation_steps gives 2")
    assert any(p.startswith("optimizer.params.lr:") and "learning_rate" in p for p in problems)
    assert any(p.startswith("scheduler.params.total_num_steps:") for p in problems)
    assert any(p.startswith("bf16.enabled:") for p in problems)
    assert all('set it to "auto"' in p for p in problems)


def test_model_parallel_sizes_are_refused():
    with pytest.raises(ConfigError, match=r"pipeline_parallel.size: 2 is not supported by ShardwiseTrainer"):
        check_config({"pipeline_parallel": {"size": 2}}, [])


def test_config_path_is_read_and_bad_files_are_named(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text('{"zero_optimization": {"stage": 3}}')
    assert read_config(path) == {"zero_optimization": {"stage": 3}}
    path.write_text("[1]")
    with pytest.raises(ConfigError, match="must hold a JSON object"):
        read_config(path)
    with pytest.raises(ConfigError, match="does not exist"):
        read_config(tmp_path / "missing.json")


def test_misuses_are_refused_with_the_fix(tmp_path):
    messages = run_distributed(refusals, 1, str(tmp_path), timeout=120)[0]
    assert "pass shardwise_config=" in messages["no config"]
    assert "gradient_accumulation_steps: the config says 4" in messages["accumulation mismatch"]
    assert "tensor_parallel.size: 2 is not supported" in messages["tensor parallel"]
    assert "keep one of them" in messages["optimizer twice"]
    assert "both shardwise_config and TrainingArguments.deepspeed" in messages["both configs"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on GPUs accelerate splits the processes without use_cpu")
def test_cpu_processes_need_use_cpu(tmp_path):
    for messages in run_distributed(refusals, 2, str(tmp_path), timeout=120):
        assert "TrainingArguments(use_cpu=True)" in messages["cpu processes"]


def test_training_arguments_deepspeed_is_read_and_taken_off(tmp_path):
    result = run_distributed(train_from_deepspeed_argument, 1, str(tmp_path), timeout=120)[0]
    assert result["stage"] == 3 and result["deepspeed_left"] is None
    assert list(result["loss"]) == [1]
