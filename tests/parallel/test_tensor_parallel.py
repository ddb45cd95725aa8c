"""Tensor parallelism (Megatron) trains exactly like one process on the same global batch:
shardwise GPT, Hugging Face Llama (GQA: 4 heads, 2 KV heads, tied embeddings) and GPT-2
(fused c_attn in Conv1D layout, biases), alone and under ZeRO 1-3 over a data-parallel
group; the tensor group's bytes equal the planner's formula."""

from functools import lru_cache

import pytest

from shardwise.planner.comm_formulas import ParallelCommShape, tensor_parallel_comm_bytes
from shardwise.testing import run_distributed
from tests.parallel.workers import assert_equivalent, parallel_case, train_parallel, train_reference
from tests.zero.workers import SEQ_LEN

WIDTH = 32  # all three tiny models
LAYERS = 2


@lru_cache(maxsize=None)
def reference(model: str, data_size: int) -> dict:
    return train_reference(parallel_case(model=model), data_size)


def expected_tensor_bytes(case, steps: int) -> dict:
    shape = ParallelCommShape(LAYERS, case.micro_batch, SEQ_LEN, WIDTH, 4, tensor_size=2)
    return {op: steps * nbytes for op, nbytes in tensor_parallel_comm_bytes(shape).items() if nbytes}


@pytest.mark.parametrize("model", ["gpt", "llama", "gpt2"])
def test_tp2_matches_single_process(model):
    case = parallel_case(stage=0, tensor=2, model=model)
    results = run_distributed(train_parallel, 2, case)
    assert_equivalent(results, reference(model, 1))
    for result in results:
        tensor = dict(result["comm_by_group"]["tensor"])
        assert tensor.pop("control") == 4 * case.steps  # the gradient norm, one float per step
        assert tensor == expected_tensor_bytes(case, case.steps)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_tp2_with_zero_over_two_data_parallel_ranks(stage):
    case = parallel_case(stage=stage, tensor=2)
    results = run_distributed(train_parallel, 4, case, timeout=240)
    assert_equivalent(results, reference("gpt", 2))
    assert {r["local_numel"] for r in results} == {results[0]["local_numel"]}  # ZeRO sees the local shards
    assert results[0]["comm_by_group"]["shard"]["reduce_scatter"] > 0


def test_tp2_zero3_llama():
    results = run_distributed(train_parallel, 4, parallel_case(stage=3, tensor=2, model="llama"), timeout=240)
    assert_equivalent(results, reference("llama", 2))
