"""Hugging Face models train unmodified (C24): tied embeddings, modules called twice,
parameters without gradients, weights read outside forward."""

from functools import lru_cache

import pytest

from shardwise.tools.testing import run_distributed
from tests.runtime.zero.workers import Case, assert_matches_reference, train_parallel, train_reference

PARTITION_EVERYTHING = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}


# GPT-2's attention key bias has an exactly zero true gradient, so Adam turns its
# rounding noise into O(lr) updates; a realistic lr and a reference that sums
# micro-batches in the ranks' order keep that noise below the 1e-5 tolerance.
LR = {"llama": 1e-2, "gpt2": 1e-3}


@lru_cache(maxsize=None)
def reference(model: str, world_size: int, accumulation: int) -> dict:
    case = Case(model=model, accumulation=accumulation, lr=LR[model])
    return train_reference(case, world_size, per_micro_batch=model == "gpt2")


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_hf_model_matches_single_process(model, stage):
    extra = PARTITION_EVERYTHING if stage == 3 else {}
    case = Case(model=model, stage=stage, accumulation=2, lr=LR[model], extra_config=extra)
    results = run_distributed(train_parallel, 2, case)
    assert results[0]["tied"], "the test model must tie input and output embeddings"
    for result in results:
        assert_matches_reference(result, reference(model, 2, 2), 1e-5)
