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
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "32"
