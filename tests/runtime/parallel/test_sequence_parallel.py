"""Sequence parallelism trains exactly like one process on the same global batch.

Megatron SP (tensor_parallel.sequence_parallel, TP=2): the decoder layers hold half of each
sequence between the tensor regions. Ulysses (sequence_parallel.size 2): each rank gets
whole sequences, the layers run on half of them and attention exchanges positions for
heads. Both on shardwise GPT, Hugging Face Llama (GQA) and GPT-2; Ulysses also under
ZeRO-3 sharded over data x sequence ranks, and with fewer KV heads than ranks (the KV
heads are repeated). The groups' bytes equal the planner's formulas.
"""

from functools import lru_cache

import pytest

from shardwise.formulas.communication import ParallelCommShape, tensor_parallel_comm_bytes, ulysses_comm_bytes
from shardwise.tools.testing import run_distributed
from tests.runtime.parallel.workers import assert_equivalent, parallel_case, train_parallel, train_reference
from tests.runtime.zero.workers import SEQ_LEN

WIDTH, LAYERS = 32, 2
HEADS = {"gpt": (2, 2), "llama": (4, 2), "gpt2": (4, 4)}  # (heads, KV heads) of the tiny models
# Megatron SP all-reduces the gradients of replicated layer parameters: fp32 bytes of each
# (32 elements): GPT and Llama 2 norms per layer, GPT-2 2 norms (weight, bias) + 2 row biases
LAYER_NORMS = {"gpt": (128,) * 4, "llama": (128,) * 4, "gpt2": (128,) * 12}


@lru_cache(maxsize=None)
def reference(model: str, data_size: int) -> dict:
    return train_reference(parallel_case(model=model), data_size)


@pytest.mark.parametrize("model", ["gpt", "llama", "gpt2"])
def test_megatron_sp_matches_single_process(model):
    case = parallel_case(stage=0, tensor=2, megatron_sp=True, model=model)
    results = run_distributed(train_parallel, 2, case)
    assert_equivalent(results, reference(model, 1))
    shape = ParallelCommShape(LAYERS, case.micro_batch, SEQ_LEN, WIDTH, 4, tensor_size=2, megatron_sp=True,
                              replicated_layer_param_bytes=LAYER_NORMS[model])
    expected = {op: case.steps * n for op, n in tensor_parallel_comm_bytes(shape).items() if n}
    tensor = dict(results[0]["comm_by_group"]["tensor"])
    tensor.pop("control")
    assert tensor == expected


@pytest.mark.parametrize("model", ["gpt", "llama", "gpt2"])
def test_ulysses_matches_single_process(model):
    case = parallel_case(stage=1, sequence=2, model=model)
    results = run_distributed(train_parallel, 2, case)
    assert_equivalent(results, reference(model, 1))
    heads, kv_heads = HEADS[model]
    shape = ParallelCommShape(LAYERS, case.micro_batch, SEQ_LEN, WIDTH, 4, sequence_size=2, heads=heads,
                              kv_heads=kv_heads)
    expected = {op: case.steps * n for op, n in ulysses_comm_bytes(shape).items()}
    assert results[0]["comm_by_group"]["sequence"] == expected


def test_ulysses_with_windows_the_caller_ends():
    """managed_gradient_accumulation false, the script stepping at each window's end."""
    case = parallel_case(stage=1, sequence=2, accumulation=2, managed_accumulation=False)
    results = run_distributed(train_parallel, 2, case)
    assert_equivalent(results, train_reference(parallel_case(accumulation=2), 1))


def test_ulysses_with_zero3_over_data_and_sequence_ranks():
    results = run_distributed(train_parallel, 4, parallel_case(stage=3, sequence=2), timeout=240)
    assert_equivalent(results, reference("gpt", 2))


def test_ulysses_repeats_kv_heads_when_fewer_than_ranks():
    case = parallel_case(stage=3, sequence=4, model="llama")  # 2 KV heads, 4 sequence ranks
    results = run_distributed(train_parallel, 4, case, timeout=240)
    assert_equivalent(results, reference("llama", 1))
    shape = ParallelCommShape(LAYERS, case.micro_batch, SEQ_LEN, WIDTH, 4, sequence_size=4, heads=4, kv_heads=2)
    assert results[0]["comm_by_group"]["sequence"] == {
        op: case.steps * n for op, n in ulysses_comm_bytes(shape).items()}
