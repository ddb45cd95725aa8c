"""Configs DeepSpeed 0.19.8 accepts and trains with load in shardwise (the refusals issue 26
called unfair), one config per shape, written in the style of real ones. With
DEEPSPEED_PYTHON set, the same configs go through DeepSpeed's own parser
(`DeepSpeedConfig`), proving it accepts them too."""

import json
import logging
import os
import subprocess

import pytest

from shardwise.frontends.deepspeed.config import load_config
from shardwise.frontends.deepspeed.config.policies import policies_from_config

ADAMW = {"type": "AdamW", "params": {"lr": 2e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}}

CONFIGS = {
    # other tools leave their own keys at the top level; DeepSpeed never reads them
    "keys_of_other_tools": {
        "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2, "optimizer": ADAMW,
        "cuda_visible_devices": "0,1,2,3", "comms_config": {"verbose": False}, "monitor_config": {"enabled": False},
    },
    "super_offload": {  # DeepSpeed's SuperOffload for Superchips: speed only
        "train_micro_batch_size_per_gpu": 2, "optimizer": ADAMW, "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True,
                                                                "super_offload": True, "cpuadam_cores_perc": 0.9}},
    },
    "data_before_expert_parallelism": {  # DeepSpeed's MoE group order (runtime/distributed/mesh.py)
        "train_micro_batch_size_per_gpu": 2, "optimizer": ADAMW, "use_data_before_expert_parallelism": True,
    },
    "disable_allgather": {
        "train_batch_size": 32, "zero_optimization": {"stage": 2, "contiguous_gradients": True},
        "disable_allgather": True, "optimizer": ADAMW,
    },
    "auto_in_offload_blocks": {
        "train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True}, "optimizer": ADAMW,
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                              "offload_param": {"device": "cpu", "pin_memory": True, "buffer_size": "auto",
                                                "buffer_count": "auto", "max_in_cpu": "auto"}},
    },
    "parameter_offload_alone": {
        "train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "optimizer": ADAMW,
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
                              "stage3_gather_16bit_weights_on_model_save": True},
    },
    "parameter_offload_below_stage_3": {
        "train_micro_batch_size_per_gpu": 2, "fp16": {"enabled": True, "loss_scale": 0}, "optimizer": ADAMW,
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
    },
    "torch_autocast": {
        "train_micro_batch_size_per_gpu": 16, "gradient_clipping": 1.0, "optimizer": ADAMW,
        "torch_autocast": {"enabled": True, "dtype": "bfloat16"}, "zero_optimization": {"stage": 2},
    },
    "bf16_master_weights_and_optimizer_states": {
        "train_micro_batch_size_per_gpu": 4, "optimizer": ADAMW, "zero_optimization": {"stage": 3},
        "bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
    },
    "bert_era_adam": {
        "train_batch_size": 64, "train_micro_batch_size_per_gpu": 8, "steps_per_print": 100,
        "optimizer": {"type": "Adam", "params": {"lr": 4e-4, "weight_decay": 0.01, "bias_correction": False}},
        "fp16": {"enabled": True, "auto_cast": True, "loss_scale": 0, "initial_scale_power": 16},
        "gradient_clipping": 1.0,
    },
    "deepcompile": {
        "train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "optimizer": ADAMW,
        "zero_optimization": {"stage": 3}, "compile": {"deepcompile": True, "passes": ["z3"]},
    },
    "moe_leaf_modules": {
        "train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "optimizer": ADAMW,
        "zero_optimization": {"stage": 3, "leaf_module": {"classes": ["MixtralSparseMoeBlock"],
                                                          "name_suffixes": "mlp.experts"}},
    },
    "drop_last_and_monitors": {
        "train_micro_batch_size_per_gpu": 2, "dataloader_drop_last": True, "optimizer": ADAMW,
        "tensorboard": {"enabled": True, "output_path": "logs/", "job_name": "train_bert"},
        "csv_monitor": {"enabled": True, "output_path": "logs/", "job_name": "train_bert"},
        "wandb": {"enabled": True, "project": "bert", "group": "ablation", "team": "nlp"},
        "comet": {"enabled": True, "project": "bert", "samples_log_interval": 50, "online": False},
    },
    "one_cycle": {
        "train_batch_size": 128, "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}},
        "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1,
                                                     "cycle_first_step_size": 1000, "decay_step_size": 1000,
                                                     "decay_lr_rate": 0.001, "cycle_momentum": True}},
    },
    "lr_range_test": {
        "train_batch_size": 128, "optimizer": ADAMW,
        "scheduler": {"type": "LRRangeTest", "params": {"lr_range_test_min_lr": 1e-5, "lr_range_test_step_size": 200,
                                                        "lr_range_test_step_rate": 5, "lr_range_test_staircase": False}},
    },
}


@pytest.mark.parametrize("name", CONFIGS)
def test_shardwise_loads_it(name):
    policies_from_config(load_config(CONFIGS[name], world_size=1))


def test_what_shardwise_ignores_it_says_once(caplog):
    with caplog.at_level(logging.WARNING, logger="shardwise"):
        load_config(CONFIGS["keys_of_other_tools"], world_size=1)
    (record,) = caplog.records
    assert "3 config key(s)" in record.message
    assert "'comms_config' ignored (DeepSpeed ignores it too); did you mean 'comms_logger'?" in record.message


DEEPSPEED_SIDE = """
import json, sys
from deepspeed.runtime.config import DeepSpeedConfig
for name, config in json.loads(sys.argv[1]).items():
    DeepSpeedConfig(config)
    print("accepted", name)
"""


@pytest.mark.skipif(not os.environ.get("DEEPSPEED_PYTHON"), reason="set DEEPSPEED_PYTHON to an interpreter with "
                    "DeepSpeed installed (benchmarks/zero3_vs_fsdp2_deepspeed.py's docstring shows one)")
def test_deepspeed_accepts_them_too():
    ran = subprocess.run([os.environ["DEEPSPEED_PYTHON"], "-c", DEEPSPEED_SIDE, json.dumps(CONFIGS)],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert [line for line in ran.stdout.splitlines() if line.startswith("accepted")] == [
        f"accepted {name}" for name in CONFIGS]


REMOVED_SIDE = """
import json
from deepspeed.runtime import config
print(json.dumps([sorted(config._REMOVED_TOP_LEVEL_CONFIG_KEYS), sorted(config._REMOVED_ZERO_CONFIG_KEYS)]))
"""


@pytest.mark.skipif(not os.environ.get("DEEPSPEED_PYTHON"), reason="set DEEPSPEED_PYTHON to an interpreter with "
                    "DeepSpeed installed (benchmarks/zero3_vs_fsdp2_deepspeed.py's docstring shows one)")
def test_the_removed_features_are_deepspeeds():
    """Every top-level key DeepSpeed refuses as removed is refused here as removed, or kept
    (sparse_attention); so is mics_shard_size among its ZeRO keys."""
    from shardwise.frontends.deepspeed.config.deepspeed_keys import KEPT_AFTER_DEEPSPEED_REMOVED, RULES, Removed

    ran = subprocess.run([os.environ["DEEPSPEED_PYTHON"], "-c", REMOVED_SIDE], check=True, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    top_level, zero = json.loads(ran.stdout.strip().splitlines()[-1])
    removed_here = {key for key, rule in RULES[""].items() if isinstance(rule, Removed)}
    assert set(top_level) == removed_here | {key for key in KEPT_AFTER_DEEPSPEED_REMOVED if "." not in key}
    assert "mics_shard_size" in zero
