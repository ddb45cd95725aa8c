"""DeepSpeedEngine's config accessors and state queries answer what DeepSpeed 0.19.8's engine
answers for the same config and optimizer: the expected values below are DeepSpeed's own
(run on CPU, one gloo rank), and with DEEPSPEED_PYTHON set the slow test asks DeepSpeed
again. DeepSpeed refuses fp16 on a CPU, so the fp16 cases follow its source
(runtime/engine.py, runtime/precision_config.py): `loss_scale()` is the configured
`fp16.loss_scale` (0: dynamic), the reduction dtype fp16."""

from __future__ import annotations

import inspect
import json
import os

import pytest
import torch

import shardwise.frontends.deepspeed.api as deepspeed
from tests.frontends.deepspeed.deepspeed_side import ONE_RANK, deepspeed_json


def _config(stage: int, precision: str | None = None, accumulation: int = 1, offload: tuple[str, ...] = (),
            optimizer: str | None = "Adam", **extra: object) -> dict:
    config: dict = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": accumulation,
                    "zero_optimization": {"stage": stage, **{f"offload_{part}": {"device": "cpu"} for part in offload}}}
    if optimizer is not None:
        config["optimizer"] = {"type": optimizer, "params": {"lr": 1e-3}}
    if precision is not None:
        config[precision] = {"enabled": True}
    return {**config, **extra}


# DeepSpeed 0.19.8's answers where a case does not say otherwise
DEFAULTS = {
    "train_micro_batch_size_per_gpu": 2, "steps_per_print": None, "gradient_clipping": 1.0,
    "dataloader_drop_last": False, "optimizer_name": "adam", "optimizer_params": {"lr": 0.001},
    "scheduler_name": None, "scheduler_params": None, "zero_allow_untested_optimizer": False,
    "wall_clock_breakdown": False, "zero_reduce_scatter": True, "zero_overlap_comm": False,
    "zero_contiguous_gradients": True, "zero_use_cpu_optimizer": False, "zero_cpu_offload": False,
    "zero_partial_offload": 1.0, "zero_sub_group_size": 1000000000, "zero_reduce_bucket_size": 500000000,
    "zero_allgather_bucket_size": 500000000, "zero_allgather_partitions": True,
    "zero_prefetch_bucket_size": 50000000, "zero_param_persistence_threshold": 100000,
    "zero_max_live_parameters": 1000000000, "zero_max_reuse_distance": 1000000000,
    "zero_module_granularity_threshold": 0, "zero_gather_16bit_weights_on_model_save": False,
    "zero_ignore_unused_parameters": True, "zero_hpz_partition_size": 1, "zero_quantized_weights": False,
    "zero_quantized_gradients": False, "zenflow_config": None, "fp16_enabled": False, "bfloat16_enabled": False,
    "fp16_auto_cast": False, "bf16_master_weights_and_gradients": False, "bf16_optimizer_states": False,
    "loss_scale": 0.0, "dynamic_loss_scale": True, "initial_dynamic_scale": 65536,
    "dynamic_loss_scale_args": {"init_scale": 65536, "scale_window": 1000, "delayed_shift": 2,
                                "consecutive_hysteresis": False, "min_scale": 1},
    "communication_data_type": "torch.float32", "get_data_types": ["torch.float32", "torch.float32"],
    "get_lr": [0.001], "get_mom": [[0.9, 0.999]], "data_efficiency_enabled": False, "autotuning_enabled": False,
    "dp_world_size": 1, "mp_world_size": 1, "seq_dp_world_size": 1, "sequence_parallel_size": 1,
    "zero_offload_optimizer.device": None, "zero_offload_param.device": None,
    # settings shardwise accepts without modelling them, and the profiler's and autotuner's
    "aio_config": {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": False,
                   "overlap_events": True, "use_gds": False},
    "autotp_size": 0, "autotuning_start_profile_step": 3, "autotuning_end_profile_step": 5,
    "autotuning_metric": "throughput", "autotuning_metric_path": os.path.join(os.getcwd(), "autotuning_metric.json"),
    "autotuning_model_info_path": os.path.join(os.getcwd(), "autotuning_model_info.json"),
    "autotuning_profile_model_info": False, "checkpoint_serialization_enabled": True,
    "checkpoint_writer_enabled": False, "cpuadam_cores_perc": 0.9, "data_sampling_enabled": False,
    "dump_state": False, "flops_profiler_detailed": True, "flops_profiler_module_depth": -1,
    "flops_profiler_output_file": None, "flops_profiler_profile_step": 1, "flops_profiler_recompute_fwd_factor": 0.0,
    "flops_profiler_top_modules": 1, "fp16_master_weights_and_gradients": False, "gradient_predivide_factor": 1.0,
    "is_deepcompile_enabled": False, "is_sanity_checks_enabled": False, "load_universal_checkpoint": False,
    "managed_gradient_accumulation": True, "optimizer_legacy_fusion": False, "postscale_gradients": True,
    "super_offload": False, "torch_autocast_dtype": None, "torch_autocast_enabled": False,
    "torch_autocast_lower_precision_safe_modules": ["torch.nn.modules.linear.Linear", "torch.nn.modules.conv.Conv1d",
                                                    "torch.nn.modules.conv.Conv2d", "torch.nn.modules.conv.Conv3d"],
    "use_node_local_storage": False, "zero_allgather_sequential": False, "zero_compute_grad_norm": True,
    "zero_elastic_checkpoint": False, "zero_force_ds_cpu_optimizer": True, "zero_legacy_stage1": False,
    "zero_load_from_fp32_weights": True, "zero_log_trace_cache_warnings": False,
    "zero_model_persistence_threshold": 9223372036854775807, "zero_multi_rank_bucket_allreduce": True,
    "zero_nvme_offload_optimizer": False, "zero_parameter_alignment": False,
    "zero_quantized_nontrainable_weights": False, "zero_round_robin_gradients": False,
    "zero_save_muon_momentum_buffer_in_memory": False,
}
STAGE = {stage: {"zero_optimization": stage > 0, "zero_optimization_stage": stage,
                 "zero_optimization_partition_gradients": stage >= 2,
                 "zero_optimization_partition_weights": stage >= 3,
                 "is_first_weights_partition_group": stage >= 3} for stage in range(4)}
# a config that sets what those accessors read
WRITTEN = {"zero_optimization": {"stage": 2, "round_robin_gradients": True, "load_from_fp32_weights": False,
                                 "use_multi_rank_bucket_allreduce": False, "allgather_sequential": True,
                                 "model_persistence_threshold": 5},
           "aio": {"block_size": 262144, "queue_depth": 32, "intra_op_parallelism": 2, "single_submit": True,
                   "overlap_events": False},
           "checkpoint": {"use_node_local_storage": True, "load_universal": True},
           "flops_profiler": {"enabled": False, "profile_step": 3, "module_depth": 2, "top_modules": 4,
                              "detailed": False, "output_file": "profile.txt"},
           "autotuning": {"enabled": False, "start_profile_step": 2, "end_profile_step": 4, "metric": "latency",
                          "metric_path": "metric.json", "model_info_path": "info.json"},
           "torch_autocast": {"enabled": True, "dtype": "bfloat16"}, "zero_force_ds_cpu_optimizer": False,
           "dump_state": True}

# (config, the optimizer the script passes: None or a torch.optim class name) -> DeepSpeed's
# answers that differ from DEFAULTS
CASES = [
    ((_config(0, fp16={"enabled": False, "loss_scale": 128, "initial_scale_power": 8, "hysteresis": 3}), None),
     {"train_batch_size": 2, "gradient_accumulation_steps": 1, **STAGE[0], "loss_scale": 128.0,
      "dynamic_loss_scale": False, "initial_dynamic_scale": 256,
      "dynamic_loss_scale_args": {"init_scale": 256, "scale_window": 1000, "delayed_shift": 3,
                                  "consecutive_hysteresis": False, "min_scale": 1}}),
    ((_config(1, "bf16", 2, gradient_clipping=0.5, steps_per_print=5, data_types={"grad_accum_dtype": "fp32"}),
      None),
     {"train_batch_size": 4, "gradient_accumulation_steps": 2, "steps_per_print": 5, "gradient_clipping": 0.5,
      **STAGE[1], "bfloat16_enabled": True, "communication_data_type": "torch.bfloat16",
      "get_data_types": ["torch.bfloat16", "torch.float32"]}),
    ((_config(2, "bf16", offload=("optimizer",), communication_data_type="fp32",
              scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 3}}), None),
     {"train_batch_size": 2, "gradient_accumulation_steps": 1, "scheduler_name": "WarmupLR",
      "scheduler_params": {"warmup_num_steps": 3}, **STAGE[2], "zero_use_cpu_optimizer": True,
      "zero_cpu_offload": True, "bfloat16_enabled": True, "get_data_types": ["torch.bfloat16", "torch.bfloat16"],
      "get_lr": [0.0], "zero_offload_optimizer.device": "cpu", "cpuadam_cores_perc": 0.8}),
    ((_config(3, accumulation=4, offload=("optimizer", "param")), None),
     {"train_batch_size": 8, "gradient_accumulation_steps": 4, **STAGE[3], "zero_overlap_comm": True,
      "zero_use_cpu_optimizer": True, "zero_cpu_offload": True, "zero_offload_optimizer.device": "cpu",
      "zero_offload_param.device": "cpu", "cpuadam_cores_perc": 0.8}),
    ((_config(2, **WRITTEN), None),
     {"train_batch_size": 2, "gradient_accumulation_steps": 1, **STAGE[2], "zero_round_robin_gradients": True,
      "zero_load_from_fp32_weights": False, "zero_multi_rank_bucket_allreduce": False,
      "zero_allgather_sequential": True, "zero_model_persistence_threshold": 5,
      "aio_config": {"block_size": 262144, "queue_depth": 32, "intra_op_parallelism": 2, "single_submit": True,
                     "overlap_events": False, "use_gds": False},
      "use_node_local_storage": True, "load_universal_checkpoint": True, "flops_profiler_profile_step": 3,
      "flops_profiler_module_depth": 2, "flops_profiler_top_modules": 4, "flops_profiler_detailed": False,
      "flops_profiler_output_file": "profile.txt", "autotuning_start_profile_step": 2,
      "autotuning_end_profile_step": 4, "autotuning_metric": "latency", "autotuning_metric_path": "metric.json",
      "autotuning_model_info_path": "info.json", "torch_autocast_enabled": True,
      "torch_autocast_dtype": "torch.bfloat16", "zero_force_ds_cpu_optimizer": False, "dump_state": True}),
    ((_config(2, optimizer=None), "AdamW"),
     {"train_batch_size": 2, "gradient_accumulation_steps": 1, "optimizer_name": "AdamW", "optimizer_params": None,
      **STAGE[2]}),
    ((_config(1, accumulation=2, optimizer=None, zero_allow_untested_optimizer=True, wall_clock_breakdown=True),
      "SGD"),
     {"train_batch_size": 4, "gradient_accumulation_steps": 2, "optimizer_name": "SGD", "optimizer_params": None,
      "zero_allow_untested_optimizer": True, "wall_clock_breakdown": True, **STAGE[1], "get_lr": [0.01],
      "get_mom": [0.9]}),
]
# DeepSpeed's fp16 answers, read from its source (a CPU cannot run them)
FP16_CASES = [
    ((_config(2, "fp16"), None),
     {"train_batch_size": 2, "gradient_accumulation_steps": 1, **STAGE[2], "fp16_enabled": True,
      "communication_data_type": "torch.float16", "get_data_types": ["torch.float16", "torch.float16"]}),
    ((_config(0, fp16={"enabled": True, "loss_scale": 1024}), None),
     {"train_batch_size": 2, "gradient_accumulation_steps": 1, **STAGE[0], "fp16_enabled": True,
      "loss_scale": 1024.0, "dynamic_loss_scale": False, "communication_data_type": "torch.float16",
      "get_data_types": ["torch.float16", "torch.float16"]}),
]

def _answers(engine, names):
    """What the engine answers, as JSON: dtypes by name, tuples as lists; "method.attribute"
    reads an attribute of the method's answer (the offload blocks are config objects in both).
    The DeepSpeed script below reads DeepSpeed's engine with this same function."""
    row = {}
    for name in names:
        method, _, attribute = name.partition(".")
        value = getattr(engine, method)
        value = value() if callable(value) else value
        if attribute:
            value = getattr(value, attribute) if value is not None else None
        value = getattr(value, "value", value)  # DeepSpeed's offload device is a str enum
        row[name] = json.loads(json.dumps(value, default=str))
    return row


NAMES = sorted(DEFAULTS) + ["train_batch_size", "gradient_accumulation_steps", *STAGE[0]]


def _expected(answers: dict) -> dict:
    return {name: answers.get(name, DEFAULTS.get(name)) for name in NAMES}


def _client(kind: str | None, model: torch.nn.Module) -> torch.optim.Optimizer | None:
    if kind is None:
        return None
    return {"AdamW": lambda: torch.optim.AdamW(model.parameters(), lr=1e-3),
            "SGD": lambda: torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)}[kind]()


@pytest.mark.parametrize("case, answers", CASES + FP16_CASES, ids=[
    "stage0-fp32-fp16-block-off", "stage1-bf16-accumulation", "stage2-bf16-offload-scheduler", "stage3-offload",
    "stage2-written-settings", "stage2-client-adamw", "stage1-client-sgd", "stage2-fp16", "stage0-fp16-static-scale"])
def test_the_accessors_answer_as_deepspeed(case, answers):
    config, client = case
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      optimizer=_client(client, model), config=config)
    try:
        assert _answers(engine, NAMES) == _expected(answers)
    finally:
        engine.destroy()


def test_loss_scale_is_the_configured_one_and_the_scaler_holds_the_current():
    model = torch.nn.Linear(4, 1)
    config = _config(0, fp16={"enabled": True, "initial_scale_power": 4, "hysteresis": 1}, optimizer="SGD")
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    try:
        engine.backward(engine(torch.full((2, 4), float("inf"))).sum())  # overflows: the scale halves
        engine.step()
        assert (engine.loss_scale(), engine.skipped_steps, engine.loss_scaler.scale) == (0.0, 1, 8.0)
    finally:
        engine.destroy()


def test_communication_data_type_can_be_set_to_the_configured_one_only():
    model = torch.nn.Linear(4, 1)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_config(1, "bf16"))
    try:
        engine.communication_data_type = torch.bfloat16  # what it is: accepted
        assert engine.communication_data_type == torch.bfloat16
        with pytest.raises(ValueError, match='"communication_data_type": "fp32" in the config'):
            engine.communication_data_type = torch.float32
        assert engine.communication_data_type == torch.bfloat16
    finally:
        engine.destroy()


DEEPSPEED_ANSWERS = """
import json, os, socket, sys, torch, deepspeed
""" + inspect.getsource(_answers) + """
""" + ONE_RANK + """
deepspeed.init_distributed()
cases, names = json.loads(sys.argv[1]), json.loads(sys.argv[2])
rows = []
for config, client in cases:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    optimizer = {None: lambda: None, "AdamW": lambda: torch.optim.AdamW(model.parameters(), lr=1e-3),
                 "SGD": lambda: torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)}[client]()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), optimizer=optimizer,
                                      config=config)
    rows.append(_answers(engine, names))
    engine.destroy()
print(json.dumps(rows))
"""


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("DEEPSPEED_PYTHON"), reason="set DEEPSPEED_PYTHON to an interpreter with "
                    "DeepSpeed 0.19.8 to compare with it")
def test_deepspeed_answers_the_same():
    answered = deepspeed_json(DEEPSPEED_ANSWERS, json.dumps([case for case, _ in CASES]), json.dumps(NAMES),
                              timeout=600)
    assert answered == [_expected(answers) for _, answers in CASES]


def test_set_train_batch_size_makes_the_next_windows_that_size():
    """Two micro-batches per update, then six samples (three micro-batches) per update: the
    weights equal plain SGD on each window's mean loss, in fp32."""
    torch.manual_seed(0)
    model, reference = torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)
    reference.load_state_dict(model.state_dict())
    batches = [torch.randn(2, 4) for _ in range(5)]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_config(
        0, accumulation=2, optimizer="SGD", gradient_clipping=0.0))
    try:
        for window, batch_size in (([0, 1], None), ([2, 3, 4], 6)):
            if batch_size is not None:
                engine.set_train_batch_size(batch_size)
            for index in window:
                engine.backward(engine(batches[index]).square().mean())
                engine.step()
            loss = torch.stack([reference(batches[index]).square().mean() for index in window]).mean()
            reference.zero_grad()
            loss.backward()
            with torch.no_grad():
                for param in reference.parameters():
                    param -= 1e-3 * param.grad
        for param, expected in zip(model.parameters(), reference.parameters()):
            assert torch.allclose(param, expected, rtol=1e-5, atol=0)
        assert (engine.train_batch_size(), engine.gradient_accumulation_steps(), engine.global_steps,
                engine.global_samples, engine.tput_timer.batch_size) == (6, 3, 2, 10, 6)
        with pytest.raises(ValueError, match="multiple of train_micro_batch_size_per_gpu x data-parallel size = 2"):
            engine.set_train_batch_size(5)
        engine.backward(engine(batches[0]).square().mean())
        engine.set_train_batch_size(6)  # its own size: nothing changes, even mid-window
        with pytest.raises(RuntimeError, match="in the middle of an accumulation window"):
            engine.set_train_batch_size(4)
    finally:
        engine.destroy()
