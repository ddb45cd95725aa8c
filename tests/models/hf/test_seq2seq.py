"""T5-style encoder-decoders found by their module names (shardwise/models/hf/seq2seq.py)
train exactly like one process at tensor_parallel.size 2 and at pipeline_parallel.size 2
(fp32, losses and final weights < 1e-5 relative): self- and cross-attention split by heads,
the relative position bias split by heads, the head tied to the shared embedding (T5) or
not with a gated MLP (T5 v1.1). The pipeline runs the encoder's blocks, its final norm and
the decoder's blocks as one sequence of 5 layers, with a stage boundary inside the encoder
(its hidden states, the decoder's embeddings and the position bias cross it), right after
it (the encoder output and the decoder's hidden states), or inside the decoder (those and
the decoder's two position biases); the tied head's weight comes from the first stage."""

import pytest

from shardwise.models import plan_for
from shardwise.tools.testing import run_distributed
from tests.models.hf.family_workers import FamilyCase, build_model, train_parallel, train_reference
from tests.models.hf.test_decoders import assert_matches

# split_points over [encoder.block.0, encoder.block.1, encoder.final_layer_norm, decoder.block.0, decoder.block.1]
BOUNDARIES = {"inside the encoder": (1,), "after the encoder": (3,), "inside the decoder": (4,)}


@pytest.mark.parametrize("family", ["t5", pytest.param("t5_gated", marks=pytest.mark.slow)])
def test_tp2_and_pp2_match_single_process(family):
    want = train_reference(FamilyCase(family))
    assert_matches(run_distributed(train_parallel, 2, FamilyCase(family, tensor=2)), want)
    pipeline = run_distributed(train_parallel, 2, FamilyCase(family, pipeline=2,
                                                             split_points=BOUNDARIES["inside the decoder"]))
    assert set(pipeline[0]["params"]).isdisjoint(pipeline[1]["params"])  # each stage keeps its own layers
    assert {"shared.weight", "decoder.block.0.layer.0.SelfAttention.q.weight"} <= set(pipeline[0]["params"])
    assert "decoder.final_layer_norm.weight" in pipeline[1]["params"]
    assert_matches(pipeline, want)


@pytest.mark.slow
@pytest.mark.parametrize("boundary", ["inside the encoder", "after the encoder"])
def test_pp2_matches_single_process_wherever_the_boundary_is(boundary):
    want = train_reference(FamilyCase("t5"))
    assert_matches(run_distributed(train_parallel, 2, FamilyCase("t5", pipeline=2,
                                                                  split_points=BOUNDARIES[boundary])), want)


def test_the_plan_splits_both_stacks_and_the_position_bias():
    styles = plan_for(build_model("t5_gated")).tensor_styles
    assert styles["decoder.block.*.layer.1.EncDecAttention.k"] == "colwise"
    assert styles["encoder.block.*.layer.1.DenseReluDense.wi_1"] == "colwise"
    assert "decoder.block.*.layer.0.SelfAttention.relative_attention_bias" in styles


def test_the_pipeline_runs_both_stacks_as_one_sequence_of_layers():
    model = build_model("t5")
    assert plan_for(model).pipeline.layer_paths(model) == [
        "encoder.block.0", "encoder.block.1", "encoder.final_layer_norm", "decoder.block.0", "decoder.block.1"]


def test_the_time_partition_measures_every_layer_of_both_stacks():
    """What passes between T5's layers is a tuple: each layer is timed on it, forward and backward."""
    from shardwise.runtime.parallel.pipeline.timing import measure_layer_costs

    model = build_model("t5")
    costs = measure_layer_costs(model, plan_for(model).pipeline, 2, 8)
    assert len(costs.layers) == 5 and min(costs.layers) >= 1 and costs.first >= 1 and costs.last >= 1
    assert all(param.grad is None for param in model.parameters())  # training starts as it would have
