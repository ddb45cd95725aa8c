"""Tensor parallelism (Megatron) trains exactly like one process on the same global batch:
shardwise GPT, Hugging Face Llama (GQA: 4 heads, 2 KV heads, tied embeddings) and GPT-2
(fused c_attn in Conv1D layout, biases), alone and under ZeRO 1-3 over a data-parallel
group; the tensor group's bytes equal the planner's formula."""

from functools import lru_cache

import pytest

from shardwise.formulas.communication import CommShape, ParallelCommShape, comm_bytes_by_group, tensor_parallel_comm_bytes
from shardwise.formulas.memory import model_state_bytes
from shardwise.formulas.layers import tensor_parallel_params
from shardwise.tools.testing import run_distributed
from tests.runtime.parallel.workers import assert_equivalent, build_model, parallel_case, train_parallel, train_reference
from tests.runtime.zero.workers import SEQ_LEN

WIDTH = 32  # all three tiny models
LAYERS = 2


@lru_cache(maxsize=None)
def reference(model: str, data_size: int) -> dict:
    return train_reference(parallel_case(model=model), data_size)


def expected_tensor_bytes(case, steps: int) -> dict:
    shape = ParallelCommShape(LAYERS, case.micro_batch, SEQ_LEN, WIDTH, 4, tensor_size=2)
    return {op: steps * nbytes for op, nbytes in tensor_parallel_comm_bytes(shape).items() if nbytes}


@pytest.mark.parametrize("model", ["gpt", "llama", "gpt2", "qwen2", "mistral"])
def test_tp2_matches_single_process(model):
    case = parallel_case(stage=0, tensor=2, model=model)
    results = run_distributed(train_parallel, 2, case)
    assert_equivalent(results, reference(model, 1))
    for result in results:
        tensor = dict(result["comm_by_group"]["tensor"])
        assert tensor.pop("control") == 4 * case.steps  # the gradient norm, one float per step
        assert tensor == expected_tensor_bytes(case, case.steps)


def test_tp2_with_windows_the_caller_ends():
    """managed_gradient_accumulation false, the script stepping at each window's end: the
    window's gradients are reduced in step(), with the tensor-split norm, as one process."""
    case = parallel_case(stage=1, tensor=2, accumulation=2, managed_accumulation=False)
    results = run_distributed(train_parallel, 4, case, timeout=240)
    assert_equivalent(results, train_reference(parallel_case(accumulation=2), 2))


def split_and_replicated(model) -> tuple[int, int]:
    """Elements of the tiny GPT that the plan splits (matrices, embedding rows) and keeps whole."""
    split = sum(p.numel() for n, p in model.named_parameters() if n == "wte.weight" or n.endswith(
        ("qkv.weight", "attn.proj.weight", "fc.weight", "mlp.proj.weight")))
    return split, sum(p.numel() for p in model.parameters()) - split


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_tp2_with_zero_over_two_data_parallel_ranks(stage):
    case = parallel_case(stage=stage, tensor=2)
    results = run_distributed(train_parallel, 4, case, timeout=240)
    assert_equivalent(results, reference("gpt", 2))
    local = tensor_parallel_params(*split_and_replicated(build_model("gpt")), 2)
    padded = local + results[0]["padding"]
    for result in results:  # ZeRO partitions each tensor rank's local shards over the 2 data ranks
        assert result["local_numel"] == local
        if stage == 1:  # fp32 with SGD momentum: K = 4
            expected = model_state_bytes(padded, 2, stage, "fp32", optimizer_state_bytes_per_param=4)
            assert {k: result["memory"][k] for k in expected} == expected
        shard = CommShape(padded, stage, 2, 1, 4, 4, persistent_params=local if stage == 3 else 0)
        assert result["comm_by_group"]["shard"]["reduce_scatter"] == case.steps * comm_bytes_by_group(
            shard)["shard"]["reduce_scatter"]


def test_tp2_zero3_llama():
    results = run_distributed(train_parallel, 4, parallel_case(stage=3, tensor=2, model="llama"), timeout=240)
    assert_equivalent(results, reference("llama", 2))
