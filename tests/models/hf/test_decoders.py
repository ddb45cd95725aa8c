"""Hugging Face decoders found by their module names (shardwise/models/hf/decoders.py) train
exactly like one process at tensor_parallel.size 2 and at pipeline_parallel.size 2 (fp32,
losses and final weights < 1e-5 relative): Gemma (scaled embedding, GQA), Gemma 2
(alternating sliding-window and full layers, soft-capped logits), Gemma 3 (q/k norms, local
and global rotary embeddings), Phi-3 (fused qkv_proj with 4 query and 2 key/value heads,
fused gate_up_proj) and Mixtral (4 experts, 2 per token, each expert split over the tensor
group).

Mixtral's router picks experts by top-k, a discontinuous choice: the test compares a
2-step trajectory, in which the tiny model's router margins (~1e-2 between logits) are
six orders of magnitude above the last-bit differences of tensor-parallel sums.
"""

from functools import lru_cache

import pytest
import torch
from torch import nn

import shardwise
from shardwise.models import ModelPlan, plan_for
from shardwise.tools.testing import DistributedTestError, run_distributed
from tests.models.hf.family_workers import FamilyCase, build_model, train_parallel, train_reference
from tests.runtime.zero.workers import relative_error

FAMILIES = ["gemma", "gemma2", "gemma3", "phi3", "mixtral"]
TOLERANCE = 1e-5


@lru_cache(maxsize=None)
def reference(family: str) -> dict:
    return train_reference(FamilyCase(family))


def assert_matches(results: list[dict], want: dict, zero_gradient: str = "\0") -> None:
    """Losses and weights within TOLERANCE; parameters named ending in `zero_gradient` (an
    attention key bias: softmax ignores a shift shared by all keys, so its true gradient is
    exactly 0 and it moves by rounding noise only) within 1e-6 absolute."""
    params = {}
    for result in results:
        for step, (got, expected) in enumerate(zip(result["losses"], want["losses"])):
            assert abs(got - expected) / expected < TOLERANCE, f"step {step}: loss {got} vs {expected}"
        params.update(result["params"])
    assert set(params) == set(want["params"])
    for name, expected in want["params"].items():
        if name.endswith(zero_gradient):
            assert (params[name] - expected).abs().max() < 1e-6, name
            continue
        error = relative_error(params[name], expected)
        assert error < TOLERANCE, f"{name}: relative error {error:.2e}"


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_and_pp2_match_single_process(family):
    want = reference(family)
    assert_matches(run_distributed(train_parallel, 2, FamilyCase(family, tensor=2)), want)
    pipeline = run_distributed(train_parallel, 2, FamilyCase(family, pipeline=2))
    assert set(pipeline[0]["params"]).isdisjoint(pipeline[1]["params"])  # each stage keeps its own layers
    assert_matches(pipeline, want)


def test_phi3_tp2_checkpoint_of_unequal_qkv_parts_converts_to_one_hugging_face_folder(tmp_path):
    """Each rank's qkv_proj holds its q rows and its (fewer) k and v rows: the checkpoint's
    pieces put them back where they are in the whole matrix."""
    from transformers import Phi3ForCausalLM

    from shardwise.runtime.checkpoint import convert_checkpoint

    run_distributed(train_parallel, 2, FamilyCase("phi3", tensor=2, save_to=str(tmp_path / "checkpoint")))
    convert_checkpoint(tmp_path / "checkpoint", tmp_path / "hf", hf=True)
    loaded = dict(Phi3ForCausalLM.from_pretrained(tmp_path / "hf").named_parameters())
    assert loaded["model.layers.0.self_attn.qkv_proj.weight"].shape == (64, 32)  # 4 q + 2 k + 2 v heads of 8
    for name, expected in reference("phi3")["params"].items():
        error = relative_error(loaded[name].detach(), expected)
        assert error < TOLERANCE, f"{name}: relative error {error:.2e}"


def test_the_plan_is_detected_from_module_names():
    styles = plan_for(build_model("phi3")).tensor_styles
    assert styles["model.layers.*.mlp.down_proj"] == "rowwise" and "model.layers.*.self_attn.qkv_proj" in styles
    mixtral = plan_for(build_model("mixtral"))
    assert mixtral.name == "Hugging Face mixtral" and "model.layers.*.mlp.experts" in mixtral.tensor_styles
    assert plan_for(build_model("gemma2")).tensor_styles["lm_head"] == "colwise_gather"  # soft-capped logits


class Unknown(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.sum()


def test_a_model_of_no_known_layout_is_told_to_write_a_model_plan():
    assert plan_for(Unknown()) == ModelPlan(name="Unknown")
    for key in ("tensor_parallel", "pipeline_parallel"):
        with pytest.raises(DistributedTestError, match=r"ModelPlan.*docs/parallelism.md#your-own-model"):
            run_distributed(_initialize, 2, key)


def test_phi3_key_value_heads_that_do_not_split_are_refused_with_the_numbers():
    with pytest.raises(DistributedTestError, match=r"tensor_parallel.size 2 must divide.*num_key_value_heads\) 1"):
        run_distributed(_initialize, 2, "tensor_parallel", "phi3_one_kv_head")


def _initialize(rank: int, world_size: int, key: str, family: str | None = None) -> None:
    model = build_model(family) if family else Unknown()
    shardwise.initialize(model, {"train_micro_batch_size_per_gpu": 1, key: {"size": 2}},
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
