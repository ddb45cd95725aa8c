"""Hugging Face Qwen3 (shardwise/models/hf/llama.py), whose attention normalises q and k per
head, trains exactly like one process at tensor_parallel.size 2 (its replicated q_norm and
k_norm see each rank's heads only, their gradients summed over the group) and at
pipeline_parallel.size 2 (fp32, losses and final weights < 1e-5 relative)."""

from shardwise.models import plan_for
from shardwise.tools.testing import run_distributed
from tests.models.hf.family_workers import FamilyCase, build_model, train_parallel, train_reference
from tests.models.hf.test_decoders import assert_matches


def test_qwen3_tp2_and_pp2_match_single_process():
    want = train_reference(FamilyCase("qwen3"))
    assert_matches(run_distributed(train_parallel, 2, FamilyCase("qwen3", tensor=2)), want)
    pipeline = run_distributed(train_parallel, 2, FamilyCase("qwen3", pipeline=2))
    assert set(pipeline[0]["params"]).isdisjoint(pipeline[1]["params"])
    assert_matches(pipeline, want)


def test_qwen3_plan_splits_by_heads_and_refuses_ulysses():
    plan = plan_for(build_model("qwen3"))
    assert "model.layers.*.self_attn.q_norm" in plan.tensor_styles and plan.ulysses is None
