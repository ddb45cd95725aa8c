"""T5-style encoder-decoders found by their module names (shardwise/models/hf/seq2seq.py)
train exactly like one process at tensor_parallel.size 2 (fp32, losses and final weights
< 1e-5 relative): self- and cross-attention split by heads, the relative position bias split
by heads, the head tied to the shared embedding (T5) or not with a gated MLP (T5 v1.1).
Pipeline parallelism is refused, naming why and what to do."""

import pytest
import torch

import shardwise
from shardwise.models import plan_for
from shardwise.tools.testing import DistributedTestError, run_distributed
from tests.models.hf.family_workers import FamilyCase, build_model, train_parallel, train_reference
from tests.models.hf.test_decoders import assert_matches


@pytest.mark.parametrize("family", ["t5", pytest.param("t5_gated", marks=pytest.mark.slow)])
def test_tp2_matches_single_process(family):
    want = train_reference(FamilyCase(family))
    assert_matches(run_distributed(train_parallel, 2, FamilyCase(family, tensor=2)), want)


def test_the_plan_splits_both_stacks_and_the_position_bias():
    styles = plan_for(build_model("t5_gated")).tensor_styles
    assert styles["decoder.block.*.layer.1.EncDecAttention.k"] == "colwise"
    assert styles["encoder.block.*.layer.1.DenseReluDense.wi_1"] == "colwise"
    assert "decoder.block.*.layer.0.SelfAttention.relative_attention_bias" in styles


def test_pipeline_parallelism_is_refused_naming_why():
    with pytest.raises(DistributedTestError, match=r"encoder output.*pipeline_parallel.size 1"):
        run_distributed(_initialize_pipeline, 2)


def _initialize_pipeline(rank: int, world_size: int) -> None:
    model = build_model("t5")
    shardwise.initialize(model, {"train_micro_batch_size_per_gpu": 1, "pipeline_parallel": {"size": 2}},
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
