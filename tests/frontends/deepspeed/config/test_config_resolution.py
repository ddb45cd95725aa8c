"""load_config on configs it must accept: DeepSpeed's defaults, "auto", batch derivation, round trips."""

import json
import logging

import pytest

from shardwise.frontends.deepspeed.config import ConfigError, ShardwiseConfig, default_config_table, load_config

# DeepSpeed's ZeRO-2 setup as its documentation writes it (config-json page and ZeRO tutorial):
# sizes as 5e8 floats, a fully spelled-out fp16 block, Adam with DeepSpeed's scheduler.
DEEPSPEED_DOCS_ZERO2 = """{
  "train_batch_size": 64,
  "train_micro_batch_size_per_gpu": 8,
  "steps_per_print": 100,
  "gradient_clipping": 1.0,
  "optimizer": {
    "type": "Adam",
    "params": {"lr": 0.00015, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01}
  },
  "scheduler": {
    "type": "WarmupLR",
    "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.00015, "warmup_num_steps": 1000}
  },
  "fp16": {
    "enabled": true,
    "loss_scale": 0,
    "loss_scale_window": 1000,
    "initial_scale_power": 16,
    "hysteresis": 2,
    "min_loss_scale": 1
  },
  "zero_optimization": {
    "stage": 2,
    "allgather_partitions": true,
    "allgather_bucket_size": 5e8,
    "overlap_comm": true,
    "reduce_scatter": true,
    "reduce_bucket_size": 5e8,
    "contiguous_gradients": true
  }
}"""


def test_deepspeed_docs_zero2_config_loads_from_a_file(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(DEEPSPEED_DOCS_ZERO2)
    cfg = load_config(path, world_size=4)
    assert isinstance(cfg, ShardwiseConfig)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (64, 8, 2)
    assert (cfg.steps_per_print, cfg.gradient_clipping) == (100, 1.0)
    zero = cfg.zero_optimization
    assert (zero.stage, zero.overlap_comm, zero.contiguous_gradients, zero.reduce_scatter) == (2, True, True, True)
    assert zero.reduce_bucket_size == 500_000_000 and type(zero.reduce_bucket_size) is int
    assert zero.allgather_bucket_size == 500_000_000 and type(zero.allgather_bucket_size) is int
    assert (cfg.fp16.enabled, cfg.fp16.loss_scale, cfg.fp16.initial_scale_power, cfg.fp16.min_loss_scale) == (
        True, 0.0, 16, 1.0)
    assert cfg.optimizer.type == "Adam"
    assert cfg.optimizer.params == {"lr": 0.00015, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.01,
                                    "amsgrad": False, "adam_w_mode": True, "torch_adam": False,
                                    "bias_correction": True}
    assert cfg.optimizer.torch_class_name == "AdamW"
    assert cfg.optimizer.torch_kwargs() == {"lr": 0.00015, "betas": (0.9, 0.95), "eps": 1e-8,
                                            "weight_decay": 0.01, "amsgrad": False}
    assert cfg.scheduler.type == "WarmupLR"
    assert cfg.scheduler.params == {"warmup_min_lr": 0.0, "warmup_max_lr": 0.00015, "warmup_num_steps": 1000,
                                    "warmup_type": "log", "last_batch_iteration": -1}


def test_auto_resolution_without_hidden_size_takes_deepspeed_defaults():
    config = {
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "fp16": {"enabled": "auto"},
        "optimizer": {"type": "adamw", "params": {"lr": 3e-4, "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
        "scheduler": {"type": "warmuplr", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                     "warmup_num_steps": 50}},
        "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                              "stage3_param_persistence_threshold": "auto"},
    }
    cfg = load_config(config, world_size=2)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (8, 4, 1)
    assert (cfg.gradient_clipping, cfg.fp16.enabled) == (0.0, False)
    assert (cfg.optimizer.type, cfg.scheduler.type) == ("AdamW", "WarmupLR")
    assert cfg.optimizer.params["betas"] == (0.9, 0.999)
    assert (cfg.optimizer.params["eps"], cfg.optimizer.params["weight_decay"]) == (1e-8, 0.0)
    assert (cfg.scheduler.params["warmup_min_lr"], cfg.scheduler.params["warmup_max_lr"]) == (0.0, 3e-4)
    zero = cfg.zero_optimization
    assert (zero.reduce_bucket_size, zero.stage3_prefetch_bucket_size, zero.stage3_param_persistence_threshold) == (
        500_000_000, 50_000_000, 100_000)


def test_auto_bucket_sizes_follow_the_hidden_size():
    config = {"train_batch_size": 8, "zero_optimization": {
        "stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto"}}
    zero = load_config(config, world_size=2, hidden_size=1024).zero_optimization
    assert zero.reduce_bucket_size == 1024 * 1024
    assert zero.stage3_prefetch_bucket_size == 943_718  # int(0.9 * 1024 * 1024)
    assert zero.stage3_param_persistence_threshold == 10_240


def test_auto_warmup_peak_without_a_config_optimizer_is_left_to_the_engine():
    config = {"train_batch_size": 8, "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}}}
    assert load_config(config, world_size=2).scheduler.params["warmup_max_lr"] is None


@pytest.mark.parametrize(
    ("config", "world_size", "expected"),
    [
        ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4}, 2, (64, 4, 8)),
        ({"train_batch_size": 64, "gradient_accumulation_steps": 4}, 2, (64, 8, 4)),
        ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4}, 2, (32, 4, 4)),
        ({"train_batch_size": 64}, 4, (64, 16, 1)),
        ({"train_micro_batch_size_per_gpu": 3}, 4, (12, 3, 1)),
        ({"train_batch_size": 48.0, "train_micro_batch_size_per_gpu": 6, "gradient_accumulation_steps": 4}, 2,
         (48, 6, 4)),
    ],
)
def test_batch_derivations(config, world_size, expected):
    cfg = load_config(config, world_size=world_size)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == expected
    assert cfg.pipeline_parallel.micro_batches == expected[2]


def test_defaults_match_deepspeed_code():
    cfg = load_config({"train_micro_batch_size_per_gpu": 1}, world_size=1)
    assert (cfg.gradient_clipping, cfg.steps_per_print, cfg.seed, cfg.optimizer, cfg.scheduler) == (
        0.0, 10, None, None, None)
    assert cfg.fp16.model_dump() == {"enabled": False, "auto_cast": False, "loss_scale": 0.0,
                                     "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2,
                                     "consecutive_hysteresis": False, "min_loss_scale": 1.0}
    assert (cfg.bf16.enabled, cfg.communication_data_type) == (False, None)
    zero = cfg.zero_optimization.model_dump()
    assert zero == {
        "stage": 0, "overlap_comm": False, "contiguous_gradients": True, "reduce_scatter": True,
        "reduce_bucket_size": 500_000_000, "allgather_partitions": True, "allgather_bucket_size": 500_000_000,
        "stage3_prefetch_bucket_size": 50_000_000, "stage3_param_persistence_threshold": 100_000,
        "stage3_max_live_parameters": 1_000_000_000, "stage3_max_reuse_distance": 1_000_000_000,
        "stage3_module_granularity_threshold": 0,
        "stage3_gather_16bit_weights_on_model_save": False, "sub_group_size": 1_000_000_000,
        "ignore_unused_parameters": True, "mics_shard_size": -1,
        "offload_optimizer": {"device": "none", "nvme_path": None, "pin_memory": False, "buffer_count": 4,
                              "ratio": 1.0},
        "offload_param": {"device": "none", "nvme_path": None, "pin_memory": False, "buffer_count": 5,
                          "buffer_size": 100_000_000},
        "zero_quantized_weights": False, "zero_hpz_partition_size": 1, "zero_quantized_gradients": False,
        "zenflow": None,
        "leaf_module": {"classes": ["transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
                                    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
                                    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock"],
                        "names": [], "name_suffixes": []},
    }
    assert cfg.aio is None
    assert (cfg.tensorboard.enabled, cfg.tensorboard.output_path, cfg.tensorboard.job_name) == (
        False, "", "DeepSpeedJobName")
    table = dict(default_config_table())
    assert table["aio.block_size"] == 1_048_576 and table["aio.queue_depth"] == 8 and table["aio.thread_count"] == 1
    assert table["scheduler.params[WarmupCosineLR].cos_min_ratio"] == 0.0001
    assert table["scheduler.params[WarmupDecayLR].warmup_max_lr"] == 0.001
    assert table["optimizer.params[Adam|AdamW].adam_w_mode"] is True


@pytest.mark.parametrize(("stage", "given", "expected"), [(3, None, True), (2, None, False), (3, False, False)])
def test_overlap_comm_defaults_on_for_stage_3_only(stage, given, expected):
    zero = {"stage": stage} if given is None else {"stage": stage, "overlap_comm": given}
    cfg = load_config({"train_batch_size": 8, "zero_optimization": zero}, world_size=2)
    assert cfg.zero_optimization.overlap_comm is expected


def test_deepspeed_spellings_are_normalised():
    cfg = load_config(
        {"train_batch_size": 8, "bfloat16": {"enabled": True}, "communication_data_type": "bfp16",
         "optimizer": {"type": "sgd", "params": {"lr": 0.1, "momentum": 0.9, "nesterov": True}},
         "zero_optimization": {"stage": 3, "stage3_gather_fp16_weights_on_model_save": True,
                               "prefetch_bucket_size": 1e6}},
        world_size=2,
    )
    assert (cfg.bf16.enabled, cfg.communication_data_type) == (True, "bf16")
    assert (cfg.optimizer.type, cfg.optimizer.torch_class_name) == ("SGD", "SGD")
    assert cfg.optimizer.torch_kwargs() == {"lr": 0.1, "momentum": 0.9, "dampening": 0.0, "weight_decay": 0.0,
                                            "nesterov": True}
    assert cfg.zero_optimization.stage3_gather_16bit_weights_on_model_save is True
    assert cfg.zero_optimization.stage3_prefetch_bucket_size == 1_000_000


def test_adam_with_coupled_weight_decay_builds_torch_adam():
    cfg = load_config({"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}},
                      world_size=2)
    assert cfg.optimizer.torch_class_name == "Adam"


def test_resolved_config_round_trips_through_json():
    cfg = load_config(json.loads(DEEPSPEED_DOCS_ZERO2), world_size=4)
    again = load_config(json.loads(json.dumps(cfg.model_dump())), world_size=4)
    assert again == cfg


def test_default_table_lists_every_resolved_key_once():
    table = default_config_table()
    keys = [key for key, _ in table]
    assert len(keys) == len(set(keys))
    cfg = load_config({"train_batch_size": 8}, world_size=2)

    def leaves(node: dict, prefix: str = "") -> set[str]:
        found = set()
        for key, value in node.items():
            found |= leaves(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}"}
        return found

    assert leaves(cfg.model_dump()) - {"optimizer", "scheduler", "aio"} <= set(keys)
    assert {"optimizer", "scheduler", "aio", "optimizer.type", "optimizer.params[SGD].momentum"} <= set(keys)
    assert dict(table)["zero_optimization.overlap_comm"] == "true for stage 3, else false"


def test_later_capability_blocks_that_stay_off_pass():
    cfg = load_config(
        {
            "train_batch_size": 8,
            "tensor_parallel": {"size": 1},
            "sequence_parallel": {"size": 1, "mode": "megatron"},
            "pipeline_parallel": {"size": 1, "schedule": "gpipe"},
            "activation_checkpointing": {"partition_activations": False, "cpu_checkpointing": False,
                                         "contiguous_memory_optimization": False, "number_checkpoints": None,
                                         "synchronize_checkpoint_boundary": False, "profile": False},
            "tensorboard": {"enabled": True, "output_path": "runs/tb", "job_name": "gpt"},
            "zero_optimization": {"offload_optimizer": {"device": "none"}, "offload_param": None},
        },
        world_size=2,
    )
    assert (cfg.sequence_parallel.mode, cfg.pipeline_parallel.schedule) == ("megatron", "gpipe")
    assert (cfg.tensorboard.enabled, cfg.tensorboard.output_path, cfg.tensorboard.job_name) == (True, "runs/tb", "gpt")
    assert cfg.zero_optimization.offload_param.device == "none"


def test_dotted_top_level_keys_set_their_path_as_trl_writes_them_for_a_reference_model():
    """TRL's prepare_deepspeed copies the trainer's config and adds bucket sizes as
    top-level dotted keys (0.9·h² a float); they override the nested values."""
    hidden = 64
    config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto"},
              "zero_optimization.reduce_bucket_size": hidden * hidden,
              "zero_optimization.stage3_param_persistence_threshold": 10 * hidden,
              "zero_optimization.stage3_prefetch_bucket_size": 0.9 * hidden * hidden}
    zero = load_config(config, world_size=2, hidden_size=hidden).zero_optimization
    assert (zero.reduce_bucket_size, zero.stage3_param_persistence_threshold,
            zero.stage3_prefetch_bucket_size) == (4096, 640, 3686)


def test_a_dotted_key_outside_a_block_or_to_an_unknown_field_is_named(caplog):
    """Inside a block the unknown field is an error; a dotted top-level key outside any block
    is an unknown top-level key, which DeepSpeed ignores: a warning."""
    with pytest.raises(ConfigError) as caught:
        load_config({"train_micro_batch_size_per_gpu": 1, "train_batch_size.x": 3,
                     "zero_optimization.nonsense": 1}, world_size=1)
    assert caught.value.problems == ["unknown key 'zero_optimization.nonsense'; the keys accepted in "
                                     "'zero_optimization' are: " + caught.value.problems[0].split("are: ")[1]]
    with caplog.at_level(logging.WARNING, logger="shardwise"):
        load_config({"train_micro_batch_size_per_gpu": 1, "train_batch_size.x": 3}, world_size=1)
    assert "unknown top-level key 'train_batch_size.x' ignored" in caplog.text
