"""BERT-style masked-LM encoders found by their module names (shardwise/models/hf/encoders.py)
train exactly like one process at tensor_parallel.size 2 and at pipeline_parallel.size 2
(fp32, losses and final weights < 1e-5 relative): BERT and RoBERTa, their MLM decoder tied
to the word embeddings (split alike by tensor parallelism; across the first and the last
pipeline stage), a quarter of the positions predicted."""

import pytest

from shardwise.models import plan_for
from shardwise.tools.testing import run_distributed
from tests.models.hf.family_workers import ENCODERS, FamilyCase, build_model, train_parallel, train_reference
from tests.models.hf.test_decoders import assert_matches


KEY_BIAS = "attention.self.key.bias"  # starts at 0 with an exactly zero true gradient


@pytest.mark.parametrize("family", ENCODERS)
def test_tp2_and_pp2_match_single_process(family):
    want = train_reference(FamilyCase(family))
    assert_matches(run_distributed(train_parallel, 2, FamilyCase(family, tensor=2)), want, KEY_BIAS)
    pipeline = run_distributed(train_parallel, 2, FamilyCase(family, pipeline=2))
    assert set(pipeline[0]["params"]).isdisjoint(pipeline[1]["params"])  # each stage keeps its own layers
    assert_matches(pipeline, want, KEY_BIAS)


def test_the_plan_is_detected_from_module_names():
    plan = plan_for(build_model("roberta"))
    assert plan.layers == "roberta.encoder.layer" and plan.tensor_styles["lm_head.decoder"] == "colwise_gather"
    assert plan_for(build_model("bert")).pipeline.last_modules == ("cls",)
