"""ZeRO-3 as code written for DeepSpeed sees it (issue 26): the `ds_*` attributes DeepSpeed
puts on partitioned parameters (DeepSpeed-Chat gathers only parameters whose `ds_status`
is NOT_AVAILABLE, and reads `ds_shape`), and Hugging Face's ZeRO-3 path
(`HfDeepSpeedConfig`, `is_deepspeed_zero3_enabled`, `from_pretrained` under `zero.Init`)
working on the compatibility package."""

import json
import os
import subprocess
import sys

import pytest
import torch

from shardwise.frontends.deepspeed.api.runtime.zero.partition_parameters import ZeroParamStatus
from shardwise.tools.testing import run_distributed
from tests.frontends.deepspeed.api import zero3_workers

AVAILABLE, NOT_AVAILABLE = ZeroParamStatus.AVAILABLE, ZeroParamStatus.NOT_AVAILABLE


def test_partitioned_parameters_carry_deepspeed_s_attributes():
    for report in run_distributed(zero3_workers.attributes, 2, 3):
        assert all(report["has_id"].values()) and report["ids_distinct"]
        assert report["ds_shape"] == report["shapes"]
        assert report["ds_numel"] == {name: torch.Size(shape).numel() for name, shape in report["shapes"].items()}
        # under stage3_param_persistence_threshold (8 elements): the last bias (4) stays whole
        assert report["ds_persist"] == {"0.weight": False, "0.bias": False, "2.weight": False, "2.bias": True}
        assert report["outside"] == {"0.weight": NOT_AVAILABLE, "0.bias": NOT_AVAILABLE, "2.weight": NOT_AVAILABLE,
                                     "2.bias": AVAILABLE}
        assert (report["inside"], report["inside_shape"], report["after"]) == (AVAILABLE, (32, 16), NOT_AVAILABLE)
        assert report["to_fetch"] == ["0.bias", "0.weight", "2.weight"]
        assert report["after_step"] == NOT_AVAILABLE
        assert not any(report["destroyed"].values())  # plain parameters again


def test_stages_below_3_leave_parameters_unmarked():
    for report in run_distributed(zero3_workers.attributes, 2, 2):
        assert not any(report["has_id"].values())


HUGGING_FACE_ZERO3 = """
import json, sys
import deepspeed
import torch
from transformers import AutoModelForCausalLM
from transformers.integrations.deepspeed import HfDeepSpeedConfig, is_deepspeed_zero3_enabled

directory = sys.argv[-1]
rank = int(__import__("os").environ["RANK"])
config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
reference = AutoModelForCausalLM.from_pretrained(directory)
handle = HfDeepSpeedConfig(config)  # kept alive, as the integration asks
enabled = is_deepspeed_zero3_enabled()
torch.manual_seed(100 + rank)  # an initialisation the load left behind would differ by rank
model = AutoModelForCausalLM.from_pretrained(directory)
# before initialize: the load (on rank 0 only) has reached every rank
loaded = {name: (param.detach() - want.detach()).abs().max().item()
          for (name, param), want in zip(model.named_parameters(), reference.parameters())}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
errors = {}
for (name, param), want in zip(model.named_parameters(), reference.parameters()):
    with deepspeed.zero.GatheredParameters([param]):
        errors[name] = (param.detach() - want.detach()).abs().max().item()
ids = torch.tensor([[1, 5, 7, 3]])
loss, want = engine(input_ids=ids, labels=ids).loss.item(), reference(input_ids=ids, labels=ids).loss.item()
with open(f"{directory}/rank{rank}.json", "w") as handle_file:
    json.dump({"enabled": enabled, "loaded": loaded, "errors": errors, "loss": loss,
               "reference_loss": want}, handle_file)
"""


def test_hugging_face_zero3_loading_under_as_deepspeed(tmp_path):
    """DeepSpeed-Chat's create_hf_model: an HfDeepSpeedConfig at stage 3, then `from_pretrained`
    (which, seeing ZeRO-3 enabled, builds under `deepspeed.zero.Init` and loads through
    `GatheredParameters(modifier_rank=0)` on rank 0 only), then `deepspeed.initialize`."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.OPTConfig(vocab_size=16, hidden_size=8, num_hidden_layers=1, ffn_dim=16,
                                    num_attention_heads=2, max_position_embeddings=16, word_embed_proj_dim=8)
    transformers.OPTForCausalLM(config).save_pretrained(tmp_path)
    script = tmp_path / "load.py"
    script.write_text(HUGGING_FACE_ZERO3)
    result = subprocess.run([sys.executable, "-m", "shardwise.tools.cli.main", "run", "--as-deepspeed", "--nproc", "2",
                             "--no-local-rank", str(script), str(tmp_path)], capture_output=True, text=True,
                            timeout=300, env={key: value for key, value in os.environ.items()
                                              if key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")})
    assert result.returncode == 0, result.stderr[-4000:]
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    for report in reports:
        assert report["enabled"]
        assert max(report["loaded"].values()) == 0.0, report["loaded"]  # before initialize too
        assert max(report["errors"].values()) == 0.0, report["errors"]  # every rank holds the saved weights
        assert abs(report["loss"] - report["reference_loss"]) <= 1e-5 * abs(report["reference_loss"])


def test_edits_inside_gathered_parameters_reach_every_rank_before_initialize():
    """A parameter built inside `zero.Init` is a ZeRO-3 parameter before any engine holds
    it: edits made on `modifier_rank` reach every rank when the block exits, as in
    DeepSpeed. Without this, Hugging Face's ZeRO-3 loader (rank 0 reads the checkpoint)
    left the other ranks with their own weights until `initialize`, and DeepSpeed-Chat's
    vocabulary resize in between drew another random stream there: other dropout masks,
    other rewards after training (test_deepspeed_chat.py). A module built outside `Init`
    is no ZeRO-3 parameter to DeepSpeed: its values stay each rank's own."""
    results = run_distributed(zero3_workers.edits_under_init, 2)
    torch.manual_seed(10)
    expected = torch.nn.Linear(4, 3)
    assert torch.equal(results[0]["inside"]["weight"], expected.weight.detach() + 1.0)
    assert torch.equal(results[1]["inside"]["weight"], results[0]["inside"]["weight"])
    assert torch.equal(results[0]["inside"]["bias"], expected.bias.detach())
    assert torch.equal(results[1]["inside"]["bias"], expected.bias.detach())
    assert not torch.equal(results[1]["outside"]["weight"], results[0]["outside"]["weight"])


def test_init_distributed_with_nccl_falls_back_to_gloo_without_cuda():
    code = ("import logging, torch.distributed as dist\n"
            "logging.basicConfig()\n"
            "import shardwise.frontends.deepspeed.api as deepspeed\n"
            "deepspeed.init_distributed(dist_backend='nccl', distributed_port=29731)\n"
            "print(dist.get_backend(), dist.get_world_size())\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["gloo", "1"]
    assert "NCCL needs CUDA, which this machine lacks; using gloo" in result.stderr
