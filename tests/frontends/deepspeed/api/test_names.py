"""DeepSpeed's module paths for activation checkpointing and sparse attention resolve to
shardwise's implementations, under the `--as-deepspeed` alias as under the package name."""

import subprocess
import sys

import torch

import shardwise.frontends.deepspeed.api as deepspeed
from shardwise.frontends.deepspeed import checkpointing as deepspeed_api
from shardwise.runtime.ops import sparse_attention


def test_checkpointing_and_sparse_attention_are_shardwise_s():
    assert deepspeed.checkpointing.checkpoint is deepspeed_api.checkpoint
    assert deepspeed.ops.sparse_attention.FixedSparsityConfig is sparse_attention.FixedSparsityConfig
    layer = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    torch.testing.assert_close(deepspeed.checkpointing.checkpoint(layer, x), layer(x))


def test_the_alias_finds_deepspeed_s_module_paths():
    code = (
        "from shardwise.frontends.deepspeed.alias import install_alias\n"
        "install_alias()\n"
        "import deepspeed\n"
        "from deepspeed.runtime.activation_checkpointing import checkpointing\n"
        "from deepspeed.ops.sparse_attention import BigBirdSparsityConfig, SparseSelfAttention\n"
        "assert checkpointing.configure is deepspeed.checkpointing.configure\n"
        "print(BigBirdSparsityConfig(num_heads=2, block=16).make_layout(64).shape)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "torch.Size([2, 4, 4])"


def test_the_modules_deepspeed_chat_and_deepspeed_s_test_harness_import():
    """DeepSpeed-Chat stopped at these imports; DeepSpeed's unit-test harness at the last two."""
    code = (
        "from shardwise.frontends.deepspeed.alias import install_alias\n"
        "install_alias()\n"
        "import deepspeed\n"
        "from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus\n"
        "from deepspeed.compression.helper import recursive_getattr, recursive_setattr\n"
        "from deepspeed.accelerator import get_accelerator, is_current_accelerator_supported\n"
        "from deepspeed.git_version_info import torch_info\n"
        "from deepspeed.runtime.zero.utils import ZeRORuntimeException\n"
        "from deepspeed.runtime.zero.config import ZeroStageEnum\n"
        "import torch\n"
        "model = torch.nn.Sequential(torch.nn.Linear(2, 3))\n"
        "recursive_setattr(model, '0.inner', torch.nn.ReLU())\n"
        "print(recursive_getattr(model, '0.weight').shape[0], type(model[0].inner).__name__,\n"
        "      deepspeed.zero.ZeroParamStatus is ZeroParamStatus, is_current_accelerator_supported(),\n"
        "      torch_info['version'] == '.'.join(torch.__version__.split('.')[:2]), deepspeed.__version__,\n"
        "      int(ZeroStageEnum.weights))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["3", "ReLU", "True", "True", "True", "0.19.8", "3"]


def test_an_unknown_tag_validation_mode_is_deepspeed_s_config_error():
    model = torch.nn.Linear(2, 2)
    config = {"train_batch_size": 1, "checkpoint": {"tag_validation": "foo"}}
    try:
        deepspeed.initialize(model=model, config=config)
    except deepspeed.DeepSpeedConfigError as error:
        assert "checkpoint.tag_validation: 'foo' is not one of Ignore, Warn, Fail" in str(error)
    else:
        raise AssertionError("no DeepSpeedConfigError")


def test_required_torch_version_compares_with_the_running_torch():
    from shardwise.frontends.deepspeed.api.utils.torch import required_torch_version

    running = float(".".join(torch.__version__.split(".")[:2]))
    assert required_torch_version(min_version=running) and required_torch_version(max_version=running + 1)
    assert not required_torch_version(min_version=running + 1)
    assert not required_torch_version(min_version=1.0, max_version=running - 0.5)


def test_the_schedule_constants_are_deepspeed_s_config_keys():
    """Scripts build a scheduler's params with these names (values as in DeepSpeed 0.19.8)."""
    from shardwise.frontends.deepspeed.api.runtime import lr_schedules

    assert lr_schedules.VALID_LR_SCHEDULES == ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR",
                                               "WarmupCosineLR"]
    assert (lr_schedules.WARMUP_NUM_STEPS, lr_schedules.CYCLE_FIRST_STEP_SIZE, lr_schedules.WARMUP_LOG_RATE) == (
        "warmup_num_steps", "cycle_first_step_size", "log")


def test_the_alias_finds_the_data_efficiency_schedules():
    code = (
        "from shardwise.frontends.deepspeed.alias import install_alias\n"
        "install_alias()\n"
        "from deepspeed.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler\n"
        "from shardwise.runtime.data.curriculum import CurriculumScheduler as ours\n"
        "assert CurriculumScheduler is ours\n"
        "s = CurriculumScheduler({'min_difficulty': 8, 'max_difficulty': 64, 'schedule_type': 'fixed_linear',\n"
        "                         'schedule_config': {'total_curriculum_step': 20, 'difficulty_step': 8}})\n"
        "print(s.update_difficulty(10))\n"
        "from deepspeed.runtime.data_pipeline.data_routing.scheduler import RandomLTDScheduler\n"
        "from shardwise.runtime.data.token_schedule import RandomLTDScheduler as ours\n"
        "assert RandomLTDScheduler is ours\n"
        "from deepspeed.runtime.data_pipeline.data_sampling.data_sampler import DeepSpeedDataSampler\n"
        "from deepspeed.runtime.data_pipeline.data_sampling.data_analyzer import DataAnalyzer\n"
        "from deepspeed.runtime.data_pipeline.data_sampling.indexed_dataset import MMapIndexedDataset\n"
        "from deepspeed.runtime.data_pipeline.constants import CURRICULUM_LEARNING_METRICS\n"
        "assert CURRICULUM_LEARNING_METRICS == 'curriculum_metrics'\n"
        "from deepspeed.runtime.data_pipeline.data_routing.basic_layer import RandomLayerTokenDrop\n"
        "from deepspeed.runtime.data_pipeline.data_routing.helper import convert_to_random_ltd\n"
        "from deepspeed.runtime.data_pipeline.data_routing.helper import save_without_random_ltd\n"
        "from shardwise.runtime.data import random_ltd\n"
        "assert RandomLayerTokenDrop is random_ltd.RandomLayerTokenDrop\n"
        "assert convert_to_random_ltd.__module__.endswith('data_pipeline.data_routing.helper')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "32"


def test_every_op_builder_is_compatible_and_load_names_the_python_class():
    """shardwise compiles no DeepSpeed op: each builder says which Python class does its op."""
    import pytest

    from shardwise.frontends.deepspeed.api.ops import op_builder
    from shardwise.frontends.deepspeed.api.ops.aio import AsyncIOBuilder

    assert deepspeed.ops.__compatible_ops__ == {"fused_adam": True, "cpu_adam": True, "fused_lamb": True,
                                                "cpu_adagrad": True, "cpu_lion": True, "fused_lion": True,
                                                "async_io": True}
    assert deepspeed.git_version_info.compatible_ops is deepspeed.ops.__compatible_ops__
    assert AsyncIOBuilder is op_builder.AsyncIOBuilder and AsyncIOBuilder.NAME == "async_io"
    with pytest.raises(RuntimeError, match="deepspeed.ops.adam.FusedAdam"):
        op_builder.FusedAdamBuilder().load()


def test_offload_names_and_the_swap_threshold_are_deepspeed_s():
    from shardwise.frontends.deepspeed.api.runtime.swap_tensor import MIN_SWAPPABLE_BYTES
    from shardwise.frontends.deepspeed.api.runtime.zero import config, offload_config

    assert offload_config.OffloadDeviceEnum is config.OffloadDeviceEnum
    assert offload_config.OffloadDeviceEnum("nvme").value == "nvme"
    assert MIN_SWAPPABLE_BYTES == 1048576  # DeepSpeed 0.19.8's value
