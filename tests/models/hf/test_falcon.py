"""Falcon causal LMs found by their module names (shardwise/models/hf/falcon.py) train exactly
like one process at tensor_parallel.size 2 and at pipeline_parallel.size 2 (fp32, losses and
final weights < 1e-5 relative), for each layout of the fused query_key_value: per key/value
group (new_decoder_architecture, 2 key/value heads), multi-query (one key/value head, the
weight kept whole and its gradient summed over the tensor group) and per head (with biases
and sequential attention and MLP)."""

import pytest

from shardwise.models import plan_for
from shardwise.tools.testing import DistributedTestError, run_distributed
from tests.models.hf.family_workers import FamilyCase, build_model, train_parallel, train_reference
from tests.models.hf.test_decoders import assert_matches

LAYOUTS = ["falcon", "falcon_multi_query", pytest.param("falcon_per_head", marks=pytest.mark.slow)]


@pytest.mark.parametrize("family", LAYOUTS)
def test_tp2_and_pp2_match_single_process(family):
    want = train_reference(FamilyCase(family))
    assert_matches(run_distributed(train_parallel, 2, FamilyCase(family, tensor=2)), want)
    pipeline = run_distributed(train_parallel, 2, FamilyCase(family, pipeline=2))
    assert set(pipeline[0]["params"]).isdisjoint(pipeline[1]["params"])  # each stage keeps its own layers
    assert_matches(pipeline, want)


def test_the_split_follows_the_fused_layout():
    grouped = plan_for(build_model("falcon"))
    assert grouped.kv_heads == 2 and grouped.tensor_styles["transformer.h.*.self_attention.query_key_value"] == "colwise"
    multi_query = plan_for(build_model("falcon_multi_query"))
    assert multi_query.kv_heads == 1 and callable(multi_query.tensor_styles[
        "transformer.h.*.self_attention.query_key_value"])


def test_selective_recompute_through_the_plan_keeps_the_losses():
    """activation_checkpointing.policy "selective" recomputes each layer of transformer.h
    (keeping its linear outputs) at tensor_parallel.size 2: the same training as one process
    without recomputation, with the multi-query weight's gradient hook under recomputation."""
    want = train_reference(FamilyCase("falcon_multi_query"))
    results = run_distributed(train_parallel, 2, FamilyCase("falcon_multi_query", tensor=2, recompute="selective"))
    assert all(result["recomputed_regions"] > 0 for result in results)
    assert_matches(results, want)
