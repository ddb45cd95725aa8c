"""The DeepSpeed configs popular projects ship, in the patterns they stand for, run unchanged:
each is filled as Hugging Face's Trainer fills its "auto" entries for a tiny model, then
trained by `deepspeed.initialize` exactly as a script would (the config's optimizer, or the
script's torch AdamW where the config has none). With DEEPSPEED_PYTHON set, DeepSpeed
0.19.8 trains the same dicts on the same model and data and the losses must agree (fp32
relative 1e-5, bf16 2e-2).

The dicts are ours, written after the patterns (docs/deepspeed.md, "Configs from public
projects", lists where each pattern comes from). DeepSpeed refuses fp16 on a CPU, so the
configs that train in fp16 run here with bf16 switched on beside their fp16 block, which
keeps its loss-scaling keys: those are still read, and checked.
"""

import copy
import json
import math
import os
from typing import Any

import pytest
import torch
from torch import nn

from shardwise.frontends.deepspeed.config import load_config
from shardwise.frontends.deepspeed.config.policies import policies_from_config
from shardwise.tools.testing import run_distributed
from tests.frontends.deepspeed.deepspeed_side import ONE_RANK, deepspeed_json

AUTO = "auto"
HIDDEN = 8
# What transformers' Trainer writes over "auto" for a model of hidden size 8 (its
# DeepSpeed integration: the TrainingArguments values, and bucket sizes from the hidden size).
# The learning rate is large so that a step's effect on the next losses shows above the bf16
# tolerance.
LR = 0.05
TRAINER_FILLS = {
    "optimizer.params.lr": LR, "optimizer.params.betas": [0.9, 0.999], "optimizer.params.eps": 1e-4,
    "optimizer.params.weight_decay": 0.0, "scheduler.params.warmup_min_lr": 0.0,
    "scheduler.params.warmup_max_lr": LR, "scheduler.params.warmup_num_steps": 1,
    "scheduler.params.total_num_steps": 3, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0, "fp16.enabled": False, "bf16.enabled": False,
    "zero_optimization.reduce_bucket_size": HIDDEN * HIDDEN,
    "zero_optimization.stage3_prefetch_bucket_size": int(0.9 * HIDDEN * HIDDEN),
    "zero_optimization.stage3_param_persistence_threshold": 10 * HIDDEN,
}
BATCH_AUTO = {"train_batch_size": AUTO, "train_micro_batch_size_per_gpu": AUTO, "gradient_accumulation_steps": AUTO,
              "gradient_clipping": AUTO}
ADAMW_AUTO = {"type": "AdamW", "params": {"lr": AUTO, "betas": AUTO, "eps": AUTO, "weight_decay": AUTO}}
FP16_DYNAMIC = {"enabled": AUTO, "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
                "hysteresis": 2, "min_loss_scale": 1}
NVME = "<nvme_path>"  # a fresh directory in each run
ON_A_CPU_IN_BF16 = {"bf16": {"enabled": True}}  # beside an fp16 block switched off (DeepSpeed: no fp16 on a CPU)

# name -> the config a project ships, in its pattern
CONFIGS: dict[str, dict[str, Any]] = {
    # ZeRO-3 with sub_group_size 0 and "auto" under names the Trainer does not fill
    # (prefetch_bucket_size, param_persistence_threshold: left to DeepSpeed's defaults), with
    # max_live_parameters / max_reuse_distance 0 (axolotl's zero3_bf16)
    "zero3_sub_group_0_with_unfilled_auto": {
        "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 0,
                              "reduce_bucket_size": AUTO, "prefetch_bucket_size": AUTO,
                              "param_persistence_threshold": AUTO, "max_live_parameters": 0,
                              "max_reuse_distance": 0, "gather_16bit_weights_on_model_save": True},
        "bf16": {"enabled": True}, **BATCH_AUTO, "wall_clock_breakdown": False},
    # the same offloading parameters and optimizer to the CPU, with the script's own torch
    # optimizer allowed there (axolotl's zero3_bf16_cpuoffload_all)
    "zero3_offload_all_with_a_torch_optimizer": {
        "zero_force_ds_cpu_optimizer": False, "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                              "offload_param": {"device": "cpu", "pin_memory": True}, "sub_group_size": 0,
                              "reduce_bucket_size": AUTO, "stage3_prefetch_bucket_size": AUTO,
                              "stage3_param_persistence_threshold": AUTO, "max_live_parameters": 0,
                              "max_reuse_distance": 0},
        "bf16": {"enabled": True}, **BATCH_AUTO},
    # Accelerate's DeepSpeedPlugin without a file: steps_per_print infinite, null nvme paths
    "accelerate_plugin_zero2": {
        "train_batch_size": AUTO, "train_micro_batch_size_per_gpu": AUTO, "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none", "nvme_path": None},
                              "offload_param": {"device": "none", "nvme_path": None},
                              "stage3_gather_16bit_weights_on_model_save": False},
        "gradient_clipping": 1.0, "steps_per_print": math.inf, "bf16": {"enabled": True},
        "zero_allow_untested_optimizer": True},
    # ZeRO-2 offloading the optimizer of the script's AdamW, which Accelerate turns into
    # DeepSpeedCPUAdam (LLaMA-Factory's ds_z2_offload_config, FastChat's s2, axolotl's zero2)
    "zero2_offload_with_the_scripts_adamw": {
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                              "allgather_partitions": True, "allgather_bucket_size": 5e8, "overlap_comm": False,
                              "reduce_scatter": True, "reduce_bucket_size": 5e8, "contiguous_gradients": True,
                              "round_robin_gradients": True},
        "bf16": {"enabled": AUTO}, "fp16": FP16_DYNAMIC, **BATCH_AUTO, "zero_allow_untested_optimizer": True},
    # no ZeRO in bf16 (LLaMA-Factory's ds_z0_config, open-instruct's stage0 configs, with the
    # Trainer's --bf16): DeepSpeed steps the script's AdamW once on zero gradients when it
    # wraps it (FP16_UnfusedOptimizer), so Adam's first real step is its second
    "zero0_bf16_with_the_scripts_adamw": {
        "bf16": {"enabled": True}, "zero_optimization": {"stage": 0}, **BATCH_AUTO, "steps_per_print": 1e5,
        "wall_clock_breakdown": False},
    # the Trainer's own ZeRO-2 example: AdamW and WarmupLR all "auto", float bucket sizes,
    # an fp16 block the Trainer switches off (transformers' ds_config_zero2, LLaVA's zero2)
    "trainer_zero2_adamw_warmup": {
        "fp16": FP16_DYNAMIC, "optimizer": ADAMW_AUTO,
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": AUTO, "warmup_max_lr": AUTO,
                                                     "warmup_num_steps": AUTO}},
        "zero_optimization": {"stage": 2, "allgather_partitions": True, "allgather_bucket_size": 2e8,
                              "overlap_comm": True, "reduce_scatter": True, "reduce_bucket_size": AUTO,
                              "contiguous_gradients": True},
        **BATCH_AUTO, "steps_per_print": 2000, "wall_clock_breakdown": False},
    # ZeRO-3 with WarmupDecayLR, 1e9 written as floats (open-instruct's stage3_no_offloading)
    "zero3_warmup_decay_float_sizes": {
        "bf16": {"enabled": AUTO}, "optimizer": ADAMW_AUTO,
        "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": AUTO, "warmup_min_lr": AUTO,
                                                          "warmup_max_lr": AUTO, "warmup_num_steps": AUTO}},
        "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
                              "reduce_bucket_size": AUTO, "stage3_prefetch_bucket_size": AUTO,
                              "stage3_param_persistence_threshold": AUTO, "stage3_max_live_parameters": 1e9,
                              "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True},
        **BATCH_AUTO, "steps_per_print": 1e5, "wall_clock_breakdown": False},
    # fixed batch sizes and fp16 loss scaling, no optimizer block: the script's own
    # (Megatron-DeepSpeed's examples_deepspeed ds_config files)
    "fp16_zero1_fixed_batches_script_optimizer": {
        "train_batch_size": 16, "train_micro_batch_size_per_gpu": 8, "steps_per_print": 1,
        "zero_optimization": {"stage": 1}, "gradient_clipping": 1.0, "prescale_gradients": False,
        "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 500, "hysteresis": 2, "min_loss_scale": 1,
                 "initial_scale_power": 11},
        "wall_clock_breakdown": False},
    # Lightning's DeepSpeedStrategy(stage=2): aio and activation-checkpointing blocks beside
    # ZeRO, a 1e12 sub-group
    "lightning_strategy_stage_2": {
        "activation_checkpointing": {"partition_activations": False, "cpu_checkpointing": False,
                                     "contiguous_memory_optimization": False,
                                     "synchronize_checkpoint_boundary": False},
        "aio": {"block_size": 1048576, "queue_depth": 8, "single_submit": False, "overlap_events": True,
                "thread_count": 1},
        "zero_optimization": {"stage": 2, "contiguous_gradients": True, "overlap_comm": True,
                              "allgather_partitions": True, "reduce_scatter": True,
                              "allgather_bucket_size": 200_000_000, "reduce_bucket_size": 200_000_000,
                              "sub_group_size": 1_000_000_000_000},
        "zero_allow_untested_optimizer": True, "train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}},
    # DeepSpeed-Chat's get_train_ds_config: ZeRO-3, hybrid engine and tensorboard blocks off
    "deepspeed_chat_training": {
        "train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 10,
        "zero_optimization": {"stage": 3, "overlap_comm": True, "offload_param": {"device": "none"},
                              "offload_optimizer": {"device": "none"}, "stage3_param_persistence_threshold": 1e4,
                              "stage3_max_live_parameters": 3e7, "stage3_prefetch_bucket_size": 3e7,
                              "memory_efficient_linear": False},
        "fp16": {"enabled": True, "loss_scale_window": 100}, "gradient_clipping": 1.0, "prescale_gradients": False,
        "wall_clock_breakdown": False,
        "hybrid_engine": {"enabled": False, "max_out_tokens": 512, "inference_tp_size": 1,
                          "release_inference_cache": False, "pin_parameters": True, "tp_gather_partition_size": 8},
        "tensorboard": {"enabled": False, "output_path": "step1_tensorboard/", "job_name": "step1"}},
    # OpenRLHF's ZeRO-3: "auto" left in keys nobody fills (DeepSpeed drops them for its
    # defaults), fp32 gradient accumulation beside bf16
    "zero3_bf16_fp32_accumulation_with_unfilled_auto": {
        "steps_per_print": 100,
        "zero_optimization": {"stage": 3, "offload_param": {"device": "none"},
                              "offload_optimizer": {"device": "none", "pin_memory": True}, "sub_group_size": AUTO,
                              "stage3_max_live_parameters": AUTO, "stage3_max_reuse_distance": AUTO,
                              "stage3_param_persistence_threshold": AUTO, "stage3_prefetch_bucket_size": AUTO,
                              "reduce_bucket_size": AUTO, "zero_hpz_partition_size": 1,
                              "zero_quantized_weights": False, "zero_quantized_gradients": False},
        "bf16": {"enabled": True}, "gradient_clipping": 1.0, "prescale_gradients": False,
        "data_types": {"grad_accum_dtype": "fp32"}, "train_micro_batch_size_per_gpu": 4, "train_batch_size": 8},
    # ZeRO-Infinity's NVMe example (DeepSpeedExamples): parameters and optimizer states on
    # NVMe, a persistence threshold that keeps every parameter of a small model whole (so no
    # parameter shard is paged: shardwise's NVMe home failed on none before)
    "zero3_nvme_params_all_persistent": {
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "zero_optimization": {
            "stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": NVME, "pin_memory": True,
                                              "buffer_count": 4, "fast_init": False, "pipeline_read": True,
                                              "pipeline_write": True},
            "offload_param": {"device": "nvme", "nvme_path": NVME, "pin_memory": True, "buffer_count": 5,
                              "buffer_size": 1e8, "max_in_cpu": 1e9},
            "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9, "stage3_prefetch_bucket_size": 5e7,
            "stage3_param_persistence_threshold": 1e5, "sub_group_size": 1e8},
        "aio": {"block_size": 1048576, "queue_depth": 8, "thread_count": 1, "single_submit": False,
                "overlap_events": True},
        "wall_clock_breakdown": False},
}


def on_nvme_at(config: dict[str, Any], path: str) -> dict[str, Any]:
    """`config` with its NVMe paths at `path`."""
    return json.loads(json.dumps(config).replace(json.dumps(NVME), json.dumps(path)))


def nvme_as_cpu(config: dict[str, Any]) -> dict[str, Any]:
    """`config` offloading to the CPU where it offloads to NVMe: DeepSpeed's async_io op needs
    libaio, which CPU test machines lack, and its NVMe offload steps as its CPU offload does."""
    return json.loads(json.dumps(config).replace('"device": "nvme"', '"device": "cpu"'))


def auto_filled(config: dict[str, Any]) -> dict[str, Any]:
    """`config` with the Trainer's values written over its "auto" entries; the ones it does
    not fill stay "auto", as it leaves them."""
    filled = copy.deepcopy(config)

    def fill(node: dict[str, Any], prefix: str) -> None:
        for key, value in node.items():
            path = prefix + key
            if value == AUTO and path in TRAINER_FILLS:
                node[key] = TRAINER_FILLS[path]
            elif isinstance(value, dict):
                fill(value, path + ".")

    fill(filled, "")
    if filled.get("train_batch_size") == AUTO:
        filled["train_batch_size"] = filled["train_micro_batch_size_per_gpu"] * filled["gradient_accumulation_steps"]
    return filled


def trainer_filled(config: dict[str, Any]) -> dict[str, Any]:
    """`auto_filled(config)` with fp16 switched to bf16 (for DeepSpeed on a CPU), and the flag
    the Trainer sets when the script's own optimizer runs under ZeRO."""
    filled = auto_filled(config)
    if filled.get("fp16", {}).get("enabled") is True:
        filled["fp16"]["enabled"] = False
        filled.update(ON_A_CPU_IN_BF16)
    if "optimizer" not in filled:
        filled["zero_allow_untested_optimizer"] = True
    return filled


# Both frameworks run this: the tiny model, its data, three optimizer steps; `deepspeed` is
# DeepSpeed itself or shardwise's compatibility package.
TRAIN = f"""
import importlib
import torch
from torch import nn

def train(deepspeed, config):
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) / 3)
    own = {{}}
    if "optimizer" not in config:
        own["optimizer"] = torch.optim.AdamW(model.parameters(), lr={LR}, eps=1e-4)
        offload = config.get("zero_optimization", {{}}).get("offload_optimizer", {{}}).get("device", "none")
        if offload != "none" and config.get("zero_force_ds_cpu_optimizer", True):
            # as Accelerate (under the Trainer) hands DeepSpeed the script's AdamW
            # (accelerate.utils.deepspeed.map_pytorch_optim_to_deepspeed)
            cpu_adam = importlib.import_module(deepspeed.__name__ + ".ops.adam").DeepSpeedCPUAdam
            own["optimizer"] = cpu_adam(own["optimizer"].param_groups, lr={LR}, weight_decay=0.0, adamw_mode=True)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config, **own)
    dtype = next(engine.module.parameters()).dtype
    micro, losses = engine.train_micro_batch_size_per_gpu(), []
    for index in range(3 * engine.gradient_accumulation_steps()):
        generator = torch.Generator().manual_seed(100 + index)
        x, y = torch.randn(micro, 8, generator=generator), torch.randn(micro, 8, generator=generator)
        loss = nn.functional.mse_loss(engine(x.to(dtype)).float(), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {{"losses": losses, "dtype": str(dtype), "steps": engine.global_steps}}
"""


def _shardwise_worker(rank: int, world_size: int, configs: dict[str, dict]) -> dict[str, dict]:
    import shardwise.frontends.deepspeed.api as deepspeed

    scope: dict[str, Any] = {}
    exec(TRAIN, scope)
    return {name: scope["train"](deepspeed, config) for name, config in configs.items()}


DEEPSPEED_SIDE = ONE_RANK + TRAIN + """
import json, sys, deepspeed
deepspeed.init_distributed("gloo")
configs = json.loads(sys.argv[1])
print(json.dumps({name: train(deepspeed, config) for name, config in configs.items()}))
"""


@pytest.fixture(scope="module")
def shardwise_runs(tmp_path_factory) -> dict[str, dict]:
    nvme = str(tmp_path_factory.mktemp("nvme"))
    configs = {name: on_nvme_at(trainer_filled(config), nvme) for name, config in CONFIGS.items()}
    return run_distributed(_shardwise_worker, 1, configs, timeout=120)[0]


@pytest.mark.parametrize("name", CONFIGS)
def test_shardwise_trains_it_unchanged(name, shardwise_runs):
    run = shardwise_runs[name]
    filled = trainer_filled(CONFIGS[name])
    accumulation = filled["train_batch_size"] // filled["train_micro_batch_size_per_gpu"] \
        if "train_batch_size" in filled else filled.get("gradient_accumulation_steps", 1)
    assert run["steps"] == 3 and len(run["losses"]) == 3 * accumulation
    assert run["dtype"] == ("torch.bfloat16" if filled.get("bf16", {}).get("enabled") else "torch.float32")
    assert all(math.isfinite(loss) for loss in run["losses"])


@pytest.mark.parametrize("blocks, steps_once", [
    ({"bf16": {"enabled": True}}, True),
    ({"fp16": {"enabled": True}}, True),
    ({}, False),  # fp32: DeepSpeed steps the torch optimizer itself
    ({"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}}, False),  # its ZeRO optimizers do not
    ({"bf16": {"enabled": True}, "pipeline_parallel": {"size": 1}}, False),  # BF16_Optimizer for a pipeline
])
def test_the_zero_gradient_step_is_taken_where_deepspeed_takes_it(blocks, steps_once):
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": LR}}, **blocks}
    precision = policies_from_config(load_config(config, world_size=1)).precision
    assert precision.initial_zero_gradient_step is steps_once


@pytest.mark.parametrize("name", CONFIGS)
def test_shardwise_fills_auto_as_the_trainer_does(name):
    """`load_config(auto_values=..., hidden_size=...)`, shardwise's own filling (what its
    Trainer integration passes), reads each config as the Trainer-filled dict."""
    values = {key: value for key, value in TRAINER_FILLS.items() if not key.startswith("zero_optimization.")}
    config = on_nvme_at(CONFIGS[name], "/tmp")
    accumulation = config.get("gradient_accumulation_steps", AUTO)  # the Trainer's own, where "auto"
    values["train_batch_size"] = values["train_micro_batch_size_per_gpu"] * (
        values["gradient_accumulation_steps"] if accumulation == AUTO else accumulation)
    ours = load_config(config, world_size=1, hidden_size=HIDDEN, auto_values=values)
    assert policies_from_config(ours) == policies_from_config(load_config(auto_filled(config), world_size=1))


@pytest.mark.skipif(not os.environ.get("DEEPSPEED_PYTHON"), reason="set DEEPSPEED_PYTHON to an interpreter with "
                    "DeepSpeed 0.19.8 to compare with it")
def test_deepspeed_trains_them_alike(shardwise_runs):
    configs = {name: nvme_as_cpu(trainer_filled(config)) for name, config in CONFIGS.items()}
    deepspeed = deepspeed_json(DEEPSPEED_SIDE, json.dumps(configs))
    for name, run in shardwise_runs.items():
        theirs = deepspeed[name]
        assert (run["dtype"], run["steps"]) == (theirs["dtype"], theirs["steps"]), name
        tolerance = 2e-2 if run["dtype"] == "torch.bfloat16" else 1e-5
        assert run["losses"] == pytest.approx(theirs["losses"], rel=tolerance), name
