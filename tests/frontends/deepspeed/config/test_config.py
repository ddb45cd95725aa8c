"""load_config on configs it must refuse: one ConfigError naming every problem, each with its key."""

import logging

import pytest

from shardwise.frontends.deepspeed.config import ConfigError, load_config
from shardwise.frontends.deepspeed.config.policies import policies_from_config

# The ZeRO-2 config of Hugging Face's DeepSpeed guide: "auto" everywhere, CPU offload, wall_clock_breakdown.
HF_ZERO2 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR",
                  "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "allgather_partitions": True, "allgather_bucket_size": 2e8, "overlap_comm": True,
                          "reduce_scatter": True, "reduce_bucket_size": 2e8, "contiguous_gradients": True},
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}


def problems_of(config: dict, world_size: int = 2, hidden_size: int | None = None) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load_config(config, world_size=world_size, hidden_size=hidden_size)
    return caught.value.problems


def test_unknown_nested_key_suggests_the_closest_supported_key():
    assert problems_of({"train_batch_size": 8, "zero_optimization": {"stgae": 2}}) == [
        "unknown key 'zero_optimization.stgae'; did you mean 'zero_optimization.stage'?"
    ]


def test_unknown_key_without_close_match_lists_the_keys_of_its_level():
    (problem,) = problems_of({"train_batch_size": 8, "fp16": {"xyz": 1}})
    assert problem.startswith("unknown key 'fp16.xyz'; the keys accepted in 'fp16' are: enabled, auto_cast,")


def test_deepspeed_keys_shardwise_lacks_are_named_as_such():
    problems = problems_of({"train_batch_size": 8, "expert_parallel": {"enabled": True, "preset_model": "mixtral"},
                            "zero_optimization": {"round_robin_gradients": False}})
    assert problems == ["'expert_parallel.preset_model' is a DeepSpeed key that shardwise does not support yet"]


def test_max_grad_norm_points_to_gradient_clipping():
    (problem,) = problems_of({"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"max_grad_norm": 1}}})
    assert "'optimizer.params.max_grad_norm' is a DeepSpeed key" in problem
    assert "use the top-level 'gradient_clipping'" in problem


@pytest.mark.parametrize(
    ("block", "expected"),
    [
        ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True},
          "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
         "bf16.bf16_master_weights_and_grads with zero_optimization.offload_optimizer.device 'cpu' is not "
         "supported yet: the offloaded step keeps fp32 masters and states on the host; keep the optimizer on the "
         "device"),
    ],
)
def test_later_capabilities_switched_on_are_refused(block, expected):
    assert problems_of({"train_batch_size": 8, **block}, world_size=8) == [expected]


def test_batch_contradiction_shows_the_arithmetic():
    config = {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4}
    assert problems_of(config, world_size=2) == [
        "train_batch_size 64 != train_micro_batch_size_per_gpu 4 * gradient_accumulation_steps 4 * world_size 2 = 32"
    ]


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4},
         "train_batch_size 30 is not divisible by train_micro_batch_size_per_gpu 4 * world_size 2 = 8, "
         "so gradient_accumulation_steps cannot be derived"),
        ({"train_batch_size": 36, "gradient_accumulation_steps": 4},
         "train_batch_size 36 is not divisible by gradient_accumulation_steps 4 * world_size 2 = 8, "
         "so train_micro_batch_size_per_gpu cannot be derived"),
        ({"train_batch_size": 7},
         "train_batch_size 7 is not divisible by gradient_accumulation_steps 1 * world_size 2 = 2, "
         "so train_micro_batch_size_per_gpu cannot be derived"),
        ({"gradient_accumulation_steps": 2},
         "set train_batch_size or train_micro_batch_size_per_gpu (or both): "
         "gradient_accumulation_steps alone does not fix the batch size"),
        ({}, "set train_batch_size or train_micro_batch_size_per_gpu (or both): neither is given"),
        ({"pipeline_parallel": {"micro_batches": 4}},
         "set train_batch_size or train_micro_batch_size_per_gpu (or both): neither is given"),
        ({"train_batch_size": True}, "train_batch_size: must be a positive integer (got True)"),
        ({"train_micro_batch_size_per_gpu": 0}, "train_micro_batch_size_per_gpu: must be a positive integer (got 0)"),
    ],
)
def test_batch_sizes_that_cannot_be_derived(config, expected):
    assert problems_of(config, world_size=2) == [expected]


def test_fp16_and_bf16_together_contradict():
    assert problems_of({"train_batch_size": 8, "fp16": {"enabled": True}, "bf16": {"enabled": True}}) == [
        "fp16.enabled and bf16.enabled are both true: choose one training precision"
    ]


def test_stage_outside_zero_to_three():
    assert problems_of({"train_batch_size": 8, "zero_optimization": {"stage": 4}}) == [
        "zero_optimization.stage: 4 is not a ZeRO stage: use 0, 1, 2 or 3"
    ]


def test_ranges_and_types_are_checked_with_the_value_given():
    problems = problems_of({
        "train_batch_size": 8,
        "zero_optimization": {"reduce_bucket_size": 0, "stage3_prefetch_bucket_size": 5.5, "contiguous_gradients": 1},
        "communication_data_type": "int8",
    })
    assert problems == [
        "communication_data_type: 'int8' is not a communication data type: use fp32, fp16 or bf16",
        "zero_optimization.contiguous_gradients: Input should be a valid boolean (got 1)",
        "zero_optimization.reduce_bucket_size: bucket size 0 must be a positive number of elements (DeepSpeed "
        "0.19.8 refuses it too: \"Input should be greater than 0\")",
        "zero_optimization.stage3_prefetch_bucket_size: Input should be a valid integer, "
        "got a number with a fractional part (got 5.5)",
    ]


def test_number_checkpoints_false_is_no_count_as_in_deepspeed_and_true_is_refused():
    switches = {"partition_activations": False, "contiguous_memory_optimization": False, "profile": False}
    config = load_config({"train_batch_size": 8,
                          "activation_checkpointing": {**switches, "number_checkpoints": False}}, world_size=1)
    assert config.activation_checkpointing.number_checkpoints is None
    assert problems_of({"train_batch_size": 8, "activation_checkpointing": {"number_checkpoints": True}}) == [
        "activation_checkpointing.number_checkpoints: expected a number, got True"
    ]


OPTIMIZER_CHOICES = ("Adam, AdamW, SGD, Adagrad, Lamb, Lars, Lion, Adafactor, Adam8bit, AdamW8bit, Muon, OneBitAdam, "
                     "OneBitLamb, ZeroOneAdam, or a torch.optim class by its exact name")


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("MuAdam", "optimizer.type 'MuAdam' is a DeepSpeed optimizer that shardwise does not support yet: "
                 f"use one of {OPTIMIZER_CHOICES}"),
        ("Adamm", f"optimizer.type 'Adamm' is unknown; did you mean 'Adam'? (choices: {OPTIMIZER_CHOICES})"),
    ],
)
def test_optimizer_types_shardwise_cannot_build(given, expected):
    assert problems_of({"train_batch_size": 8, "optimizer": {"type": given, "params": {"lr": 1e-3}}}) == [expected]


def test_bad_optimizer_params_are_named_under_optimizer_params():
    problems = problems_of({"train_batch_size": 8,
                            "optimizer": {"type": "AdamW", "params": {"betaz": [0.9, 0.99], "eps": 0}}})
    assert problems == [
        "unknown key 'optimizer.params.betaz'; did you mean 'optimizer.params.betas'?",
        "optimizer.params.eps: Input should be greater than 0 (got 0)",
    ]


def test_an_unknown_key_names_the_deepspeed_keys_the_block_accepts_too():
    """The block's fields, then the DeepSpeed keys accepted without a field of their own
    (not the removed ones), as Time-LLM's `bf16.auto_cast` would want to see them."""
    [problem] = problems_of({"train_batch_size": 8, "bf16": {"enabled": True, "auto_cast": True}})
    assert problem == ("unknown key 'bf16.auto_cast'; the keys accepted in 'bf16' are: enabled, "
                       "bf16_master_weights_and_grads, bf16_optimizer_states, check_grad_overflow, immediate_grad_update")
    [problem] = problems_of({"train_batch_size": 8, "bf16": {"enabled": True, "check_grad_overflw": True}})
    assert problem == "unknown key 'bf16.check_grad_overflw'; did you mean 'bf16.check_grad_overflow'?"


def test_params_of_one_optimizer_are_unknown_to_another():
    assert problems_of({"train_batch_size": 8, "optimizer": {"type": "SGD", "params": {"betas": [0.9, 0.9]}}}) == [
        "unknown key 'optimizer.params.betas'; the keys accepted in 'optimizer.params' are: "
        "lr, momentum, dampening, weight_decay, nesterov, set_grad_none"
    ]


def test_adamw_without_decoupled_weight_decay_contradicts():
    (problem,) = problems_of({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"adam_w_mode": False}}})
    assert problem.startswith("optimizer.params.adam_w_mode false contradicts optimizer.type 'AdamW'")


def test_scheduler_ending_before_its_warmup_loads_as_in_deepspeed():
    """DeepSpeed only warns (its schedule warns when built), so the config loads."""
    config = {"train_batch_size": 8, "scheduler": {"type": "WarmupDecayLR",
                                                   "params": {"total_num_steps": 100, "warmup_num_steps": 500}}}
    assert load_config(config, world_size=2).scheduler.params["total_num_steps"] == 100


def test_one_cycle_needs_its_bounds_and_cosine_its_total_steps():
    assert problems_of({"train_batch_size": 8, "scheduler": {"type": "OneCycle", "params": {}}}) == [
        "scheduler.params.cycle_min_lr: required key is missing", "scheduler.params.cycle_max_lr: required key is missing"
    ]
    assert problems_of({"train_batch_size": 8, "scheduler": {"type": "WarmupCosineLR"}}) == [
        "scheduler.params.total_num_steps: required key is missing"
    ]


def test_nvme_offload_needs_a_path():
    problems = problems_of({"train_batch_size": 8, "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "nvme"}}})
    assert problems == [
        "zero_optimization.offload_param.device is 'nvme' but zero_optimization.offload_param.nvme_path is not set",
    ]


@pytest.mark.parametrize("zero", [{"stage": 0, "offload_optimizer": {"device": "cpu"}}, {"cpu_offload": True}])
def test_optimizer_offload_without_zero_is_ignored_with_a_warning(zero, caplog):
    """DeepSpeed 0.19.8 accepts it at stage 0 and offloads nothing (its CPU Adam steps the
    parameters where they are): stage 0 has no partition to offload."""
    with caplog.at_level(logging.WARNING, logger="shardwise"):
        cfg = load_config({"train_batch_size": 8, "zero_optimization": zero}, world_size=2)
    assert policies_from_config(cfg).zero.offload_optimizer.device == "none"
    assert "'zero_optimization.offload_optimizer.device' 'cpu' at zero_optimization.stage 0" in caplog.text


def test_parameter_offload_below_stage_3_is_ignored_with_a_warning_as_in_deepspeed(caplog):
    """DeepSpeed 0.19.8 accepts offload_param at stages 0-2 and never reads it there."""
    config = {"train_batch_size": 8, "zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}
    with caplog.at_level(logging.WARNING, logger="shardwise"):
        cfg = load_config(config, world_size=2)
    assert policies_from_config(cfg).zero.offload_param.device == "none"
    assert "'zero_optimization.offload_param.device' 'cpu' at zero_optimization.stage 2" in caplog.text


def test_parameter_offload_without_optimizer_offload_loads():
    """DeepSpeed trains it: stage-3 shards on the host, the optimizer on the device."""
    config = {"train_batch_size": 8, "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}
    zero = policies_from_config(load_config(config, world_size=2)).zero
    assert (zero.offload_param.device, zero.offload_optimizer.device) == ("cpu", "none")


def test_auto_learning_rate_names_the_argument_that_fills_it():
    assert problems_of({"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"lr": "auto"}}}) == [
        "optimizer.params.lr: 'auto' needs the caller's value: pass auto_values={'optimizer.params.lr': ...} to "
        "initialize() (shardwise train fills it from --lr), or write it"
    ]


def test_auto_where_nothing_can_derive_it():
    assert problems_of({"train_batch_size": 8, "steps_per_print": "auto"}) == [
        "steps_per_print: 'auto' needs the caller's value: pass auto_values={'steps_per_print': ...} to "
        "initialize(), or write it"
    ]


def test_auto_inside_deepspeeds_pydantic_blocks_is_the_default():
    """DeepSpeed's config models drop "auto" (config_utils.py), so the field keeps its default."""
    cfg = load_config({"train_batch_size": 8, "fp16": {"hysteresis": "auto"}, "zero_optimization": {
        "stage": 3, "offload_param": {"device": "cpu", "buffer_size": "auto", "buffer_count": "auto"}}}, world_size=2)
    assert cfg.fp16.hysteresis == 2
    assert (cfg.zero_optimization.offload_param.buffer_size, cfg.zero_optimization.offload_param.buffer_count) == (
        100_000_000, 5)


@pytest.mark.parametrize("old_name_enabled", [True, False])
def test_bfloat16_beside_bf16_is_ignored_as_deepspeed_reads_bf16_first(old_name_enabled, caplog):
    with caplog.at_level(logging.WARNING, logger="shardwise"):
        cfg = load_config({"train_batch_size": 8, "bf16": {"enabled": not old_name_enabled},
                           "bfloat16": {"enabled": old_name_enabled}}, world_size=1)
    assert cfg.bf16.enabled is not old_name_enabled
    assert "'bfloat16': 'bf16' is set too" in caplog.text


def test_bfloat16_alone_is_bf16():
    assert load_config({"train_batch_size": 8, "bfloat16": {"enabled": True}}, world_size=1).bf16.enabled


def test_a_zero_alias_beside_its_name_is_still_refused():
    assert problems_of({"train_batch_size": 8, "zero_optimization": {
        "stage": 3, "prefetch_bucket_size": 10, "stage3_prefetch_bucket_size": 10}}) == [
        "'zero_optimization.prefetch_bucket_size' and 'zero_optimization.stage3_prefetch_bucket_size' are both set; "
        "'prefetch_bucket_size' is DeepSpeed's other name for 'stage3_prefetch_bucket_size', keep one"
    ]


def test_hugging_face_zero2_config_reports_all_its_problems_at_once():
    problems = problems_of(HF_ZERO2, world_size=2)
    assert problems == [
        "optimizer.params.lr: 'auto' needs the caller's value: pass auto_values={'optimizer.params.lr': ...} to "
        "initialize() (shardwise train fills it from --lr), or write it",
        "scheduler.params.warmup_num_steps: 'auto' needs the caller's value: pass "
        "auto_values={'scheduler.params.warmup_num_steps': ...} to initialize() (shardwise train fills it from "
        "--steps), or write it",
        "set train_batch_size or train_micro_batch_size_per_gpu (or both): neither is given; the config says "
        "'auto': pass auto_values={'train_micro_batch_size_per_gpu': ...} to initialize() (shardwise train fills "
        "train_batch_size from its default), or write it",
    ]
    with pytest.raises(ConfigError, match=r"^3 problems in the shardwise config:\n  - optimizer.params.lr"):
        load_config(HF_ZERO2, world_size=2)


def test_hugging_face_zero2_config_loads_with_the_callers_values():
    cfg = load_config(HF_ZERO2, world_size=2, hidden_size=64, auto_values={
        "optimizer.params.lr": 3e-4, "optimizer.params.betas": [0.9, 0.95],
        "scheduler.params.warmup_num_steps": 10, "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
    })
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (16, 4, 2)
    assert cfg.optimizer.params["lr"] == 3e-4 and list(cfg.optimizer.params["betas"]) == [0.9, 0.95]
    assert cfg.scheduler.params["warmup_num_steps"] == 10 and cfg.scheduler.params["warmup_max_lr"] == 3e-4
    assert cfg.zero_optimization.reduce_bucket_size == 200_000_000  # the config's number, not auto
    assert cfg.fp16.enabled is False


def test_bad_files(tmp_path):
    duplicated = tmp_path / "dup.json"
    duplicated.write_text('{"train_batch_size": 8, "zero_optimization": {"stage": 1, "stage": 2}}')
    broken = tmp_path / "broken.json"
    broken.write_text('{"train_batch_size": 8,}')
    with pytest.raises(ConfigError, match=r"dup.json sets 'stage' twice in the same object"):
        load_config(duplicated, world_size=1)
    with pytest.raises(ConfigError, match=r"broken.json is not valid JSON: .* at line 1, column 24"):
        load_config(str(broken), world_size=1)
    with pytest.raises(ConfigError, match=r"missing.json does not exist"):
        load_config(tmp_path / "missing.json", world_size=1)
    with pytest.raises(ConfigError, match="world_size must be a positive integer, got 0"):
        load_config({"train_batch_size": 8}, world_size=0)
    with pytest.raises(ConfigError, match="world_size must be a positive integer, got None"):
        load_config({"train_batch_size": 8}, world_size=None)


def test_a_base64_encoded_config_is_read_as_deepspeed_reads_it():
    """DeepSpeed takes a config string that names no file as base64 (its autotuner passes
    configs so); text that is neither is the missing file's error."""
    import base64
    import json

    encoded = base64.urlsafe_b64encode(json.dumps({"train_batch_size": 8, "zero_optimization": {
        "stage": 2}}).encode()).decode()
    cfg = load_config(encoded, world_size=2)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.zero_optimization.stage) == (8, 4, 2)
    with pytest.raises(ConfigError, match="nor is the text a base64-encoded JSON config"):
        load_config(base64.urlsafe_b64encode(b"[1, 2]").decode(), world_size=1)


def test_deepspeeds_field_names_of_its_stage3_aliases_load():
    """DeepSpeed 0.19.8's ZeRO model takes each stage3_ key under its field name too."""
    cfg = load_config({"train_batch_size": 8, "zero_optimization": {
        "stage": 3, "allgather_sequential": True, "model_persistence_threshold": 5,
        "use_all_reduce_for_fetch_params": False, "prefetch_bucket_size": 7}}, world_size=1)
    assert cfg.zero_optimization.stage3_prefetch_bucket_size == 7
    with pytest.raises(ConfigError, match="'zero_optimization.allgather_sequential' and "
                                          "'zero_optimization.stage3_allgather_sequential' are both set"):
        load_config({"train_batch_size": 8, "zero_optimization": {
            "stage": 3, "allgather_sequential": True, "stage3_allgather_sequential": True}}, world_size=1)


def test_older_deepspeed_spellings_are_translated_to_shardwise_keys():
    cfg = load_config({"train_batch_size": 8, "sequence_parallel_size": 1,
                       "zero_optimization": {"stage": 2, "cpu_offload": True, "cpu_offload_use_pin_memory": True}},
                      world_size=2)
    assert cfg.zero_optimization.offload_optimizer.device == "cpu"
    assert cfg.zero_optimization.offload_optimizer.pin_memory is True
    assert cfg.sequence_parallel.size == 1


def test_fp32_allreduce_is_ignored_as_deepspeed_0_19_8_ignores_it(caplog):
    """DeepSpeed 0.19.8's code never reads the key: it reduces in the training dtype."""
    cfg = load_config({"train_batch_size": 8, "bf16": {"enabled": True}, "fp32_allreduce": True}, world_size=2)
    assert cfg.communication_data_type is None
    assert "'fp32_allreduce' true: DeepSpeed 0.19.8 no longer reads it" in caplog.text


def test_harmless_keys_load_and_switched_on_features_are_refused_with_the_fix():
    harmless = {"train_batch_size": 8, "_comment": "notes", "wall_clock_breakdown": True, "prescale_gradients": False,
                "zero_allow_untested_optimizer": True, "wandb": {"enabled": False, "project": "p"},
                "zero_optimization": {"stage": 1, "round_robin_gradients": True, "ignore_unused_parameters": True}}
    assert load_config(harmless, world_size=2).zero_optimization.stage == 1
    assert problems_of({**harmless, "amp": {"enabled": True},
                        "zero_optimization": {"zero_quantized_nontrainable_weights": True}}) == [
        "'zero_optimization.zero_quantized_nontrainable_weights' true is not supported: frozen weights stored in "
        "int8 are not supported (ZeRO++'s zero_quantized_weights quantizes what gathers carry) (accepted: false)",
        "'amp' is a feature DeepSpeed 0.19.8 has removed (it refuses the key at any value, switched off too): "
        "NVIDIA Apex AMP: remove the block; use the bf16, fp16 or torch_autocast block",
    ]
    # a removed feature's block switched off is refused too, as DeepSpeed 0.19.8 refuses it
    # (each form checked against it in test_deepspeed_refuses.py)
    for off in ({"amp": {"enabled": False}}, {"elasticity": {}}, {"compression_training": {}},
                {"sparse_gradients": False}, {"curriculum_learning": {"enabled": False}}):
        [problem] = problems_of({**harmless, **off})
        assert f"'{next(iter(off))}' is a feature DeepSpeed 0.19.8 has removed" in problem and "remove the" in problem
    # a comment is only a comment at the top level, where DeepSpeed never reads unknown keys
    assert problems_of({"train_batch_size": 8, "fp16": {"_comment": "x"}})[0].startswith("unknown key 'fp16._comment'")


def _unused_parameters_config(stage: int, ignore: bool, offload: bool) -> dict:
    zero = {"stage": stage, "ignore_unused_parameters": ignore}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {"train_batch_size": 2, "zero_optimization": zero}


@pytest.mark.parametrize(("stage", "ignore", "offload", "refuses"), [
    (2, False, True, True),
    (1, False, True, True),
    (2, True, True, False),  # DeepSpeed's default
    (2, False, False, False),  # DeepSpeed checks only when it sums the gradient norm on the host
    (3, False, True, False),  # its stage-3 optimizer never checks
    (0, False, False, False),
])
def test_ignore_unused_parameters_false_is_checked_where_deepspeed_checks(stage, ignore, offload, refuses):
    """Found by running DeepSpeed 0.19.8 (tests/runtime/zero/test_unused_parameters.py has the check)."""
    policies = policies_from_config(load_config(_unused_parameters_config(stage, ignore, offload), world_size=1))
    assert policies.zero.refuse_unused_parameters is refuses

