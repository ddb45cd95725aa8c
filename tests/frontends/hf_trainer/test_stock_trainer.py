"""A stock Hugging Face Trainer script (scripts/stock_trainer.py: `TrainingArguments(
deepspeed=config)`, no shardwise import) under `shardwise run --as-deepspeed`, as a
DeepSpeed user runs it. With DeepSpeed's AutoTP (`tensor_parallel.autotp_size` 2 on 2
ranks) transformers calls `deepspeed.tp_model_init` and fills `train_batch_size` as
micro x accumulation x world, which DeepSpeed 0.19.8 requires there; the two ranks are
one data-parallel replica, so every logged loss equals the same script on one process
(fp32, relative error < 1e-5). At ZeRO-3 with the optimizer offloaded, the Trainer's
checkpoints, `save_model` and resuming work as under DeepSpeed, and so they do for a PEFT
LoRA model at ZeRO-3.

The launches go through the accelerate tests' gloo_for_nccl.py: on a machine without
GPUs accelerate gives a DeepSpeed launch no process group (with DeepSpeed itself too)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.frontends.accelerate.deepspeed_launch import launch_as_deepspeed

pytest.importorskip("transformers", reason="the Trainer tests need the transformers extra")

HERE = Path(__file__).resolve().parent
BATCH = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
         "gradient_clipping": "auto"}


def _run(tmp_path: Path, name: str, nproc: int, config: dict, *options: str) -> list[float]:
    config_file, output = tmp_path / f"{name}.json", tmp_path / name
    config_file.write_text(json.dumps(config))
    launch_as_deepspeed(HERE / "scripts" / "stock_trainer.py", str(config_file), str(output), *options, nproc=nproc)
    return json.loads((output / "losses.json").read_text())


def _assert_close(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want) == 4
    for value, expected in zip(got, want):
        assert abs(value - expected) <= 1e-5 * abs(expected), (got, want)


@pytest.mark.slow  # the default run: test_autotp_batch.py and tp_model_init's test (tests/frontends/deepspeed/api)
def test_autotp_config_trains_as_one_process(tmp_path):
    reference = _run(tmp_path, "one", 1, {"zero_optimization": {"stage": 1}, **BATCH})
    split = _run(tmp_path, "autotp", 2, {"zero_optimization": {"stage": 1}, "tensor_parallel": {"autotp_size": 2},
                                         **BATCH})
    _assert_close(split, reference)


@pytest.mark.slow  # the default run: the LoRA test below (save, save_model, resume at ZeRO-3)
def test_zero3_offload_saves_the_model_and_resumes(tmp_path):
    """ZeRO-3 with the optimizer offloaded and the Trainer's "auto" optimizer and
    scheduler: `save_model` reads the stage from `engine.config` as a dict, as DeepSpeed's
    is (an AttributeError before), and writes the gathered weights; resuming from the
    step-2 checkpoint logs the uninterrupted run's losses."""
    config = {"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True,
                                    "offload_optimizer": {"device": "cpu"}},
              "optimizer": {"type": "AdamW", "params": dict.fromkeys(("lr", "weight_decay", "betas", "eps"), "auto")},
              "scheduler": {"type": "WarmupDecayLR", "params": dict.fromkeys(
                  ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps"), "auto")}, **BATCH}
    whole = _run(tmp_path, "whole", 2, config)
    assert (tmp_path / "whole" / "final" / "model.safetensors").is_file()
    resumed = _run(tmp_path, "resumed", 2, config, "--resume", str(tmp_path / "whole" / "checkpoint-2"))
    _assert_close(resumed, whole)


@pytest.mark.slow  # the default run: tests/runtime/checkpoint/test_partial_load.py, test_engine_config.py
def test_lora_at_zero3_saves_without_the_frozen_model_and_resumes(tmp_path):
    """A PEFT LoRA model: the Trainer saves with `exclude_frozen_parameters=True` and resumes
    with `load_module_strict=False` (refused before: the checkpoint held every parameter);
    the checkpoint holds the adapter's parameters only, `save_model` writes the adapter, and
    the resumed run logs the uninterrupted one's losses."""
    config = {"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}, **BATCH}
    whole = _run(tmp_path, "lora", 2, config, "--lora")
    saved = json.loads((tmp_path / "lora" / "checkpoint-2" / "global_step2" / "meta.json").read_text())
    assert saved["frozen_parameters_excluded"] and all("lora_" in entry["name"] for entry in saved["parameters"])
    assert (tmp_path / "lora" / "final" / "adapter_model.safetensors").is_file()
    resumed = _run(tmp_path, "lora-resumed", 2, config, "--lora", "--resume", str(tmp_path / "lora" / "checkpoint-2"))
    _assert_close(resumed, whole)
