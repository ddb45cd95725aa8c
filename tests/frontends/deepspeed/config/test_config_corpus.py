"""Configs in the shape of real public ones (tests/frontends/deepspeed/config/corpus/, one file per config, named
after the project whose config it copies the shape of: Hugging Face transformers and
accelerate, LLaMA-Factory, LLaVA, Qwen, stanford_alpaca, FastChat, OpenRLHF,
DeepSpeedExamples, DeepSpeed's own tests). Each must load, or fail with exactly the
problems recorded in corpus_expected.json, both as written and with the values a Hugging Face
Trainer would fill its "auto" entries with.

After a deliberate change of behaviour, regenerate corpus_expected.json with
`.venv/bin/python tests/frontends/deepspeed/config/test_config_corpus.py` and review its diff.
"""

import json
from pathlib import Path

import pytest

from shardwise.frontends.deepspeed.config import ConfigError, load_config

CORPUS = Path(__file__).parent / "corpus"
EXPECTED = Path(__file__).parent / "corpus_expected.json"
WORLD_SIZE = 8
HIDDEN_SIZE = 1024
# What transformers' Trainer fills "auto" with (TrainingArguments: learning_rate, adam_beta1/2,
# adam_epsilon, weight_decay, warmup_steps, max_steps, per_device_train_batch_size, ...).
TRAINER_VALUES = {
    "optimizer.params.lr": 5e-5, "optimizer.params.betas": [0.9, 0.999], "optimizer.params.eps": 1e-8,
    "optimizer.params.weight_decay": 0.0, "scheduler.params.warmup_min_lr": 0, "scheduler.params.warmup_max_lr": 5e-5,
    "scheduler.params.warmup_num_steps": 10, "scheduler.params.total_num_steps": 100,
    "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
    "fp16.enabled": False, "bf16.enabled": False, "zero_optimization.stage3_gather_16bit_weights_on_model_save": True,
}
MODES = {"as_written": None, "trainer_filled": TRAINER_VALUES}


def outcome(path: Path, auto_values: dict | None) -> str | list[str]:
    try:
        load_config(path, world_size=WORLD_SIZE, hidden_size=HIDDEN_SIZE, auto_values=auto_values)
    except ConfigError as error:
        return error.problems
    return "loads"


def current_outcomes() -> dict:
    return {path.stem: {mode: outcome(path, values) for mode, values in MODES.items()}
            for path in sorted(CORPUS.glob("*.json"))}


def test_the_corpus_is_large_and_mostly_loads():
    expected = json.loads(EXPECTED.read_text())
    assert len(expected) >= 50
    filled = [result["trainer_filled"] for result in expected.values()]
    assert sum(result == "loads" for result in filled) >= 40


@pytest.mark.parametrize("name", sorted(path.stem for path in CORPUS.glob("*.json")))
def test_config_loads_or_reports_exactly(name):
    want = json.loads(EXPECTED.read_text())[name]
    for mode, values in MODES.items():
        assert outcome(CORPUS / f"{name}.json", values) == want[mode], mode


if __name__ == "__main__":
    EXPECTED.write_text(json.dumps(current_outcomes(), indent=1) + "\n")
