"""Pipeline parallelism trains exactly like one process on the same global batch (losses,
final weights and an evaluation loss, fp32 relative error < 1e-5): every schedule at
pp=2 on shardwise's GPT (tied embedding across the first and last stage), Hugging Face
Llama, Qwen2 and GPT-2, pp=2 x dp=2 with ZeRO-1 and ZeRO-2, and dp=2 x tp=2 x pp=2. The bytes each rank
sends point to point equal the planner's formula to the byte, and the micro-batches held
at once equal the schedule's formula."""

import dataclasses
from functools import lru_cache

import pytest

from shardwise.formulas.communication import PipelineCommShape, pipeline_p2p_bytes
from shardwise.formulas.layers import pipeline_micro_batches_in_flight
from shardwise.tools.testing import run_distributed
from tests.runtime.parallel.pipeline_workers import (
    SEQ_LEN,
    VOCAB,
    PipeCase,
    reference_eval_loss,
    train_pipeline,
    train_reference,
)
from tests.runtime.zero.workers import relative_error

WIDTH = 32  # the tiny GPT and Llama
TOLERANCE = 1e-5


@lru_cache(maxsize=None)
def reference(case: PipeCase, data_size: int) -> dict:
    return train_reference(case, data_size)


def merged_parameters(results: list[dict]) -> dict:
    """Each stage's parameters under their original names, checked disjoint."""
    merged = {}
    for result in results:
        merged.update(result["params"])
    return merged


def assert_matches(results: list[dict], case: PipeCase, data_size: int, tolerance: float = TOLERANCE) -> None:
    want = reference(dataclasses.replace(case, dtype="fp32"), data_size)
    for result in results:  # the mean loss is returned on every rank
        for step, (got, expected) in enumerate(zip(result["losses"], want["losses"])):
            assert abs(got - expected) / expected < tolerance, f"step {step}: loss {got} vs {expected}"
    params = merged_parameters(results)
    assert set(params) == set(want["params"])
    for name, expected in want["params"].items():
        error = relative_error(params[name], expected)
        assert error < tolerance, f"{name}: relative error {error:.2e}"
    expected_eval = reference_eval_loss(case, data_size, want["params"])
    for result in results:
        assert abs(result["eval_loss"] - expected_eval) / expected_eval < tolerance


def assert_p2p_bytes(results: list[dict], case: PipeCase, tied_bytes: int, element_bytes: int = 4) -> None:
    shape = PipelineCommShape(case.micro_batch, SEQ_LEN, WIDTH, element_bytes, case.pipeline, case.micro_batches,
                              case.virtual, tied_bytes)
    for result in results:
        for step_volume in result["comm_by_group"]:
            assert step_volume["pipeline"]["send"] == pipeline_p2p_bytes(shape, result["pipeline_rank"])


def schedule_case(schedule: str) -> PipeCase:
    interleaved = schedule == "interleaved"
    return PipeCase(schedule=schedule, virtual=2 if interleaved else 1, model="gpt4" if interleaved else "gpt")


@lru_cache(maxsize=None)
def pp2_run(schedule: str) -> list[dict]:
    return run_distributed(train_pipeline, 2, schedule_case(schedule))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved"])
def test_pp2_matches_single_process(schedule):
    interleaved = schedule == "interleaved"
    case = schedule_case(schedule)
    results = pp2_run(schedule)
    assert_matches(results, case, 1)
    assert_p2p_bytes(results, case, tied_bytes=VOCAB * WIDTH * 4)
    for result in results:
        expected = pipeline_micro_batches_in_flight(schedule, 2, case.micro_batches, result["pipeline_rank"],
                                                    case.virtual)
        assert [timing["peak"] for timing in result["timings"]] == [expected] * case.steps
    if interleaved:
        assert [result["chunks"] for result in results] == [[[0], [2]], [[1], [3]]]


def test_peak_activation_memory_gpipe_holds_m_micro_batches_1f1b_holds_p():
    """Bytes autograd saved for backward (weights excluded), at their peak per stage:
    GPipe m times one micro-batch's, 1F1B (p - stage) times (stage 0: p)."""
    m = schedule_case("gpipe").micro_batches
    for gpipe, one_f_one_b in zip(pp2_run("gpipe"), pp2_run("1f1b")):
        stage = gpipe["pipeline_rank"]
        gpipe_peak = {timing["peak_bytes"] for timing in gpipe["timings"]}
        assert len(gpipe_peak) == 1 and gpipe_peak.pop() % m == 0
        one = gpipe["timings"][0]["peak_bytes"] // m
        assert one > 0
        assert {timing["peak_bytes"] for timing in one_f_one_b["timings"]} == {(2 - stage) * one}


@pytest.mark.parametrize("model", ["llama", "qwen2", "gpt2"])
def test_pp2_hugging_face_with_its_own_loss(model):
    """A dict of forward kwargs (input_ids, labels); the loss is the model's loss_function.
    Llama: GQA 4/2 heads, tied embeddings; Qwen2 (q/k/v biases) and GPT-2 (fused c_attn
    with bias, Conv1D), both tied, trained with SGD: the key bias's true gradient is exactly zero, and AdamW turns its rounding noise into
    updates of size lr (tests/runtime/zero/workers.py, build_model)."""
    case = PipeCase(model=model) if model == "llama" else PipeCase(model=model, optimizer="sgd", lr=0.05)
    results = run_distributed(train_pipeline, 2, case)
    assert_matches(results, case, 1)
    assert_p2p_bytes(results, case, tied_bytes=VOCAB * WIDTH * 4)


@pytest.mark.parametrize("model", ["gpt4", "llama"])
def test_pp2_split_by_measured_time(model):
    """partition "time": each rank times every layer on a synthetic micro-batch, all take
    rank 0's numbers, so both stages hold complementary layers; the timing run leaves no
    trace (random generators restored, gradients dropped): training equals one process."""
    case = PipeCase(model=model, partition="time")
    results = run_distributed(train_pipeline, 2, case)
    assert_matches(results, case, 1)
    layers = sorted(index for result in results for chunk in result["chunks"] for index in chunk)
    assert layers == list(range(4 if model == "gpt4" else 2))
    assert all(result["chunks"][0] for result in results)


def test_pp2_untied_gpt_with_inputs_labels_and_a_loss_fn():
    case = PipeCase(model="gpt-untied", batch_form="pair", micro_batches=3)
    results = run_distributed(train_pipeline, 2, case)
    assert_matches(results, case, 1)
    assert_p2p_bytes(results, case, tied_bytes=0)


def test_pp2_in_bf16():
    """bf16 parameters and activations (2 bytes sent per element), fp32 masters; against
    the fp32 reference at the bf16 tolerance. SGD: AdamW turns bf16 rounding into updates
    of size lr (8e-2 relative here for the plain engine at pp=1 as well)."""
    case = PipeCase(dtype="bf16", optimizer="sgd", lr=0.05)
    results = run_distributed(train_pipeline, 2, case)
    assert_matches(results, case, 1, tolerance=2e-2)
    assert_p2p_bytes(results, case, tied_bytes=VOCAB * WIDTH * 2, element_bytes=2)


@pytest.mark.parametrize("stage", [1, 2])
def test_pp2_dp2_with_zero(stage):
    case = PipeCase(stage=stage)
    results = run_distributed(train_pipeline, 4, case, timeout=240)
    assert_matches(results, case, 2)
    assert_p2p_bytes(results, case, tied_bytes=VOCAB * WIDTH * 4)
    for result in results:  # ZeRO reduces over the data-parallel ranks of the same stage
        assert result["comm_by_group"][0]["shard"]["reduce_scatter"] > 0


def test_dp2_tp2_pp2_on_eight_processes():
    """Tensor parallelism inside each stage, ZeRO-1 over the data-parallel pair."""
    case = PipeCase(tensor=2, stage=1, optimizer="sgd", lr=0.05)
    results = run_distributed(train_pipeline, 8, case, timeout=400)
    assert_matches(results, case, 2)
    shape = PipelineCommShape(case.micro_batch, SEQ_LEN, WIDTH, 4, 2, case.micro_batches, 1, VOCAB * WIDTH * 4 // 2)
    for result in results:  # the tied weight is each tensor rank's half of the vocabulary
        assert result["comm_by_group"][0]["pipeline"]["send"] == pipeline_p2p_bytes(shape, result["pipeline_rank"])
