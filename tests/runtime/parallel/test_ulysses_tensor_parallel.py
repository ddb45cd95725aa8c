"""Ulysses sequence parallelism together with tensor parallelism (T=2 × S=2 on 4 ranks):
tensor parallelism splits the heads first, Ulysses exchanges each tensor rank's heads over
the sequence group. Equal to the single-process run (fp32, < 1e-5), with both groups'
bytes equal to the formulas; too few heads per tensor rank is an error with the numbers."""

import torch

import shardwise
from shardwise.formulas.communication import ParallelCommShape, tensor_parallel_comm_bytes, ulysses_comm_bytes
from shardwise.tools.testing import run_distributed
from tests.runtime.parallel.workers import assert_equivalent, parallel_case, train_parallel, train_reference
from tests.runtime.zero.workers import SEQ_LEN, build_model

WIDTH, LAYERS = 32, 2


def test_llama_gqa_tp2_ulysses2_matches_single_process_and_the_formulas():
    case = parallel_case(stage=1, tensor=2, sequence=2, model="llama")  # 4 heads, 2 KV heads: 1 per tensor rank
    results = run_distributed(train_parallel, 4, case, timeout=300)
    assert_equivalent(results, train_reference(case, 1))
    shape = ParallelCommShape(LAYERS, case.micro_batch, SEQ_LEN, WIDTH, 4, tensor_size=2, sequence_size=2,
                              heads=4, kv_heads=2)
    tensor = dict(results[0]["comm_by_group"]["tensor"])
    tensor.pop("control")
    assert tensor == {op: case.steps * n for op, n in tensor_parallel_comm_bytes(shape).items() if n}
    assert results[0]["comm_by_group"]["sequence"] == {
        op: case.steps * n for op, n in ulysses_comm_bytes(shape).items()}


def test_gpt2_tp2_ulysses2_under_zero3_matches_single_process():
    case = parallel_case(stage=3, tensor=2, sequence=2, model="gpt2")
    assert_equivalent(run_distributed(train_parallel, 4, case, timeout=300), train_reference(case, 1))


def initialize_error(rank: int, world_size: int) -> str:
    model = build_model("gpt")  # 2 heads: 1 per tensor rank, not enough for 2 sequence ranks
    config = {"train_micro_batch_size_per_gpu": 1, "tensor_parallel": {"size": 2},
              "sequence_parallel": {"size": 2, "mode": "ulysses"}}
    try:
        shardwise.initialize(model, config, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    except ValueError as error:
        return str(error)
    return ""


def test_too_few_heads_per_tensor_rank_is_an_error_with_the_numbers():
    message = run_distributed(initialize_error, 4)[0]
    assert ("sequence_parallel.size 2 must divide the model's 1 attention heads that each rank of "
            "tensor_parallel.size 2 holds") in message
