"""Configs DeepSpeed 0.19.8 refuses at `deepspeed.initialize` for a reason that holds on
every accelerator are refused here too, each with the key, the reason and the fix; the
neighbour each rule must not catch still loads. With DEEPSPEED_PYTHON set, DeepSpeed
itself initializes every config: the refused ones must raise its error quoted here, the
neighbours it can build on a CPU must not raise (its CPU accelerator refuses fp16 before
any config check, so that one device check is lifted in the subprocess)."""

import json
import os

import pytest
import torch

from shardwise.frontends.deepspeed.config import ConfigError, load_config
from shardwise.frontends.deepspeed.config.policies import precision_policy
from tests.frontends.deepspeed.deepspeed_side import ONE_RANK, deepspeed_json

ADAMW = {"type": "AdamW", "params": {"lr": 1e-3}}
LAMB = {"type": "Lamb", "params": {"lr": 1e-3}}


def _config(**blocks: object) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": ADAMW, **blocks}


# name -> (config, the key path shardwise's error names, DeepSpeed's words for its own refusal)
REFUSED = {
    "bf16_accumulating_in_fp32_without_zero": (
        _config(bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp32"}),
        "data_types.grad_accum_dtype", "unsupported mix of model_dtype"),
    "fp16_accumulating_in_fp32_without_zero": (
        _config(fp16={"enabled": True}, data_types={"grad_accum_dtype": "fp32"}),
        "data_types.grad_accum_dtype", "unsupported mix of model_dtype"),
    "lamb_with_a_static_loss_scale": (
        _config(optimizer=LAMB, fp16={"enabled": True, "loss_scale": 128}),
        "fp16.loss_scale", "lamb optimizer requires dynamic loss scaling"),
    "lamb_with_a_static_loss_scale_in_bf16": (
        _config(optimizer=LAMB, bf16={"enabled": True}, fp16={"enabled": False, "loss_scale": 128}),
        "fp16.loss_scale", "lamb optimizer requires dynamic loss scaling"),
    "cpu_offload_beside_offload_optimizer": (
        _config(zero_optimization={"stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "cpu"}}),
        "'zero_optimization.cpu_offload' and 'zero_optimization.offload_optimizer'",
        "Cannot provide deprecated parameter"),
    "cpu_offload_false_beside_offload_optimizer": (
        _config(zero_optimization={"stage": 2, "cpu_offload": False, "offload_optimizer": {"device": "cpu"}}),
        "'zero_optimization.cpu_offload' and", "Cannot provide deprecated parameter"),
    "cpu_offload_param_beside_offload_param": (
        _config(zero_optimization={"stage": 3, "cpu_offload_param": True, "offload_param": {"device": "cpu"}}),
        "'zero_optimization.cpu_offload_param' and", "Cannot provide deprecated parameter"),
    "a_fractional_min_loss_scale": (
        _config(fp16={"enabled": False, "min_loss_scale": 0.5}), "fp16.min_loss_scale", "valid integer"),
    "an_offload_ratio_with_nothing_offloaded_below_stage_3": (
        _config(zero_optimization={"stage": 1, "offload_optimizer": {"device": "none", "ratio": 0.5}}),
        "zero_optimization.offload_optimizer.ratio", "Partial offloading only supported for ZeRO Stage 3"),
    "an_offload_ratio_without_zero": (
        _config(zero_optimization={"stage": 0, "offload_optimizer": {"ratio": 0.5}}),
        "zero_optimization.offload_optimizer.ratio", "Partial offloading only supported for ZeRO Stage 3"),
    "a_wall_clock_breakdown_that_is_not_a_switch": (
        _config(wall_clock_breakdown="yes"), "'wall_clock_breakdown'", "unsupported operand"),
    "autocast_modules_that_are_not_names": (
        _config(torch_autocast={"enabled": False, "lower_precision_safe_modules": [1]}),
        "'torch_autocast.lower_precision_safe_modules'", "Expected list of strings"),
    "a_parallel_write_stage_that_is_not_a_switch": (
        _config(checkpoint={"parallel_write": {"pipeline_stage": "yes"}}), "'checkpoint.parallel_write'",
        "expecting: true or false"),
    # removed features' keys, switched off: DeepSpeed 0.19.8 refuses them at any value
    "apex_amp_switched_off": (_config(amp={"enabled": False}), "'amp'", "has been removed"),
    "an_empty_compression_block": (_config(compression_training={}), "'compression_training'", "has been removed"),
    "elasticity_switched_off": (_config(elasticity={"enabled": False}), "'elasticity'", "has been removed"),
    "legacy_curriculum_switched_off": (_config(curriculum_learning={"enabled": False}), "'curriculum_learning'",
                                       "has been removed"),
    "progressive_layer_drop_switched_off": (_config(progressive_layer_drop={"enabled": False}),
                                            "'progressive_layer_drop'", "has been removed"),
    "moq_switched_off": (_config(quantize_training={"enabled": False}), "'quantize_training'", "has been removed"),
    "eigenvalue_switched_off": (_config(eigenvalue={"enabled": False}), "'eigenvalue'", "has been removed"),
    "nebula_switched_off": (_config(nebula={"enabled": False}), "'nebula'", "has been removed"),
    "sparse_gradients_false": (_config(sparse_gradients=False), "'sparse_gradients'", "has been removed"),
    "graph_harvesting_false": (_config(graph_harvesting=False), "'graph_harvesting'", "has been removed"),
}
# what each rule must leave alone: name -> (config, whether DeepSpeed 0.19.8 initializes it
# on a CPU: its fused LAMB has no CPU kernel, and partial offload below stage 3 is
# shardwise's own, docs/deepspeed.md)
STILL_ACCEPTED = {
    "bf16_accumulating_in_fp32_with_zero": (
        _config(bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp32"}, zero_optimization={"stage": 1}), True),
    "fp32_accumulating_in_fp32_without_zero": (_config(data_types={"grad_accum_dtype": "fp32"}), True),
    "lamb_with_dynamic_loss_scaling": (_config(optimizer=LAMB, fp16={"enabled": True, "loss_scale": 0}), False),
    "adam_with_a_static_loss_scale": (_config(fp16={"enabled": True, "loss_scale": 128}), True),
    "cpu_offload_alone": (_config(zero_optimization={"stage": 2, "cpu_offload": True}), True),
    "a_whole_min_loss_scale_written_as_a_float": (_config(fp16={"enabled": True, "min_loss_scale": 2.0}), True),
    "an_offload_ratio_with_nothing_offloaded_at_stage_3": (
        _config(zero_optimization={"stage": 3, "offload_optimizer": {"device": "none", "ratio": 0.5}}), True),
    "switches_written_as_integers": (
        _config(wall_clock_breakdown=1, checkpoint={"parallel_write": {"pipeline_stage": 0}}), True),
    "autocast_modules_by_name": (
        _config(torch_autocast={"enabled": False, "lower_precision_safe_modules": ["torch.nn.Linear"]}), True),
    "partial_offload_at_stage_1": (
        _config(zero_optimization={"stage": 1, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}), False),
}


@pytest.mark.parametrize("name", REFUSED)
def test_shardwise_refuses_it_naming_the_key(name):
    config, key, _ = REFUSED[name]
    with pytest.raises(ConfigError) as refused:
        load_config(config, world_size=1)
    assert key in str(refused.value)
    assert "DeepSpeed 0.19.8" in str(refused.value)  # the reason says DeepSpeed refuses it too


@pytest.mark.parametrize("name", STILL_ACCEPTED)
def test_the_neighbours_still_load(name):
    load_config(STILL_ACCEPTED[name][0], world_size=1)


def test_cpu_offload_alone_still_offloads():
    assert load_config(STILL_ACCEPTED["cpu_offload_alone"][0], world_size=1).zero_optimization.offload_optimizer.device \
        == "cpu"


@pytest.mark.parametrize("spelling", ["fp32", "float32", "torch.float32"])
def test_fp32_accumulation_under_zero_is_honoured_without_a_warning(spelling, caplog):
    """DeepSpeed adds micro-batches' gradients in fp32 there, and so does shardwise: the
    key becomes the precision policy's accumulation dtype (tests/runtime/zero/
    test_grad_accum_fp32.py trains with it), and nothing is said about it."""
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
              "bf16": {"enabled": True}, "zero_optimization": {"stage": 2}, "data_types": {"grad_accum_dtype": spelling}}
    precision = precision_policy(load_config(config, world_size=1))
    assert (precision.param_dtype, precision.accumulation_dtype) == (torch.bfloat16, torch.float32)
    assert "grad_accum_dtype" not in caplog.text


def test_fp32_accumulation_beside_bf16_masters_is_refused():
    """bf16.bf16_master_weights_and_grads keeps bf16 gradients for the bf16 masters: there is
    no fp32 gradient to accumulate into."""
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2},
              "bf16": {"enabled": True, "bf16_master_weights_and_grads": True},
              "data_types": {"grad_accum_dtype": "fp32"}}
    with pytest.raises(ConfigError, match="the bf16 masters take bf16 gradients"):
        load_config(config, world_size=1)


DEEPSPEED_SIDE = """
import json, os, socket, sys, torch, deepspeed
from deepspeed.accelerator import get_accelerator
get_accelerator().is_fp16_supported = lambda: True  # the CPU's own refusal, which would hide the config's
""" + ONE_RANK + """
deepspeed.init_distributed("gloo")
errors = {}
for name, config in json.loads(sys.argv[1]).items():
    model = torch.nn.Linear(4, 4)
    try:
        deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        errors[name] = None
    except Exception as error:
        errors[name] = f"{type(error).__name__}: {error}"
print(json.dumps(errors), flush=True)
os._exit(0)  # ZenFlow's worker thread, left running, aborts an ordinary exit
"""


def deepspeed_initialize_errors(configs: dict[str, dict]) -> dict[str, str | None]:
    """Each config through DeepSpeed 0.19.8's `initialize` (DEEPSPEED_PYTHON, its CPU
    accelerator, its CPU-only fp16 refusal switched off): None where it initializes, else
    its error."""
    return deepspeed_json(DEEPSPEED_SIDE, json.dumps(configs))


@pytest.mark.skipif(not os.environ.get("DEEPSPEED_PYTHON"), reason="set DEEPSPEED_PYTHON to an interpreter with "
                    "DeepSpeed 0.19.8 to compare with it")
def test_deepspeed_refuses_them_and_initializes_the_neighbours():
    configs = {name: config for name, (config, _, _) in REFUSED.items()}
    configs |= {name: config for name, (config, on_cpu) in STILL_ACCEPTED.items() if on_cpu}
    errors = deepspeed_initialize_errors(configs)
    for name, (_, _, deepspeed_words) in REFUSED.items():
        assert errors[name] is not None and deepspeed_words in errors[name], (name, errors[name])
    assert {name: errors[name] for name, (_, on_cpu) in STILL_ACCEPTED.items() if on_cpu} == {
        name: None for name, (_, on_cpu) in STILL_ACCEPTED.items() if on_cpu}
