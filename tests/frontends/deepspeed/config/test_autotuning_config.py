"""DeepSpeed's `autotuning` block read as DeepSpeed 0.19.8 reads it (autotuning/config.py):
its keys and defaults, and the refusals DeepSpeed does not make (it ignores unknown keys).
With DEEPSPEED_PYTHON set, DeepSpeed's own parser gives the same defaults."""

import json
import os
import subprocess

import pytest

from shardwise.frontends.deepspeed.config import load_config
from shardwise.frontends.deepspeed.config.errors import ConfigError
from shardwise.frontends.deepspeed.config.policies import policies_from_config

# DeepSpeedAutotuningConfig's attributes for an empty block, read by running DeepSpeed 0.19.8 on CPU
DEEPSPEED_DEFAULTS = {
    "enabled": False, "fast": True, "results_dir": "autotuning_results", "exps_dir": "autotuning_exps",
    "overwrite": True, "start_profile_step": 3, "end_profile_step": 5, "metric": "throughput", "metric_path": None,
    "tuner_type": "gridsearch", "tuner_early_stopping": 5, "tuner_num_trials": 50, "arg_mappings": None,
    "model_info": None, "model_info_path": None, "mp_size": 1, "max_train_batch_size": None,
    "min_train_batch_size": 1, "max_train_micro_batch_size_per_gpu": 1024, "min_train_micro_batch_size_per_gpu": 1,
    "num_tuning_micro_batch_sizes": 3,
}


def load(block: dict):
    return load_config({"train_batch_size": 4, "autotuning": block}, world_size=2)


def test_defaults_are_deepspeeds():
    assert load({}).autotuning.model_dump() == DEEPSPEED_DEFAULTS


@pytest.mark.skipif(not os.environ.get("DEEPSPEED_PYTHON"), reason="DEEPSPEED_PYTHON (DeepSpeed 0.19.8) not set")
def test_defaults_match_deepspeeds_own_parser():
    probe = ("import json; from deepspeed.runtime.config import DeepSpeedConfig; "
             "c = DeepSpeedConfig({'train_batch_size': 4, 'autotuning': {}}).autotuning_config; "
             f"print(json.dumps({{k: getattr(c, k) for k in {sorted(DEEPSPEED_DEFAULTS)!r}}}))")
    done = subprocess.run([os.environ["DEEPSPEED_PYTHON"], "-c", probe], capture_output=True, text=True,
                          env={**os.environ, "DS_ACCELERATOR": "cpu"}, check=True, timeout=300)
    assert json.loads(done.stdout.strip().splitlines()[-1]) == DEEPSPEED_DEFAULTS


def test_enabled_block_makes_a_trial_policy(tmp_path):
    config = load_config({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3,
                          "autotuning": {"enabled": True, "metric_path": str(tmp_path / "m.json"),
                                         "start_profile_step": 1, "end_profile_step": 4}}, world_size=2)
    trial = policies_from_config(config).trial
    assert (trial.metric_path, trial.start_step, trial.end_step, trial.train_batch_size) == (
        str(tmp_path / "m.json"), 1, 4, 12)
    assert policies_from_config(load({"metric": "latency"})).trial is None  # off: a plain run


def test_default_metric_path_is_deepspeeds(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    trial = policies_from_config(load({"enabled": True})).trial
    assert trial.metric_path == str(tmp_path / "autotuning_metric.json")


@pytest.mark.parametrize(("block", "expected"), [
    ({"enabled": True, "bogus": 1}, "autotuning.bogus"),
    ({"start_step": 2}, "did you mean 'autotuning.start_profile_step'"),
    ({"metric": "speed"}, "autotuning.metric"),
    ({"tuner_type": "bayes"}, "autotuning.tuner_type"),
    ({"results_dir": ""}, "autotuning.results_dir"),
    ({"start_profile_step": 6, "end_profile_step": 5}, "is before start_profile_step"),
    ({"model_info": {"profile": True}}, "does not run a model-profiling experiment"),
    ({"model_info": {"num_params": 10, "heads": 2}}, "autotuning.model_info.heads"),
])
def test_refusals_name_the_key_and_the_fix(block, expected):
    with pytest.raises(ConfigError) as error:
        load(block)
    assert expected in str(error.value)
