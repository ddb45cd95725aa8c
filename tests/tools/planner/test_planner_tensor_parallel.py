"""The estimator with tensor (--tp, --megatron-sp) and Ulysses (--sp) sizes, and the
tensor-parallel size it suggests when ZeRO alone needs offload or does not fit (issue 10
item 5)."""

import pytest

from shardwise.formulas.memory import placed_model_state_bytes
from shardwise.formulas.layers import layer_activation_bytes
from shardwise.formulas.parallel_activation import (
    ModelParallel,
    parallel_activation_bytes,
    parallel_layer_activation_bytes,
)
from shardwise.tools.planner.recommend import Hardware, estimate
from shardwise.formulas.model_shape import ModelShape
from shardwise.models.shapes import preset_shape
from tests.tools.planner.test_planner_cli import run_estimate, table_rows

S, B, H, A = 4096, 2, 4096, 32
ONE_SEQUENCE = {"seq_len": S, "micro_batch": B, "dtype": "bf16"}


def test_one_rank_is_the_single_gpu_formula():
    assert parallel_layer_activation_bytes(S, B, H, A, "bf16") == layer_activation_bytes(S, B, H, A, "bf16")


def test_megatron_sp_divides_the_whole_layer_by_t():
    for t in (2, 4, 8):
        parallel = ModelParallel(tensor=t, megatron_sp=True)
        assert parallel_layer_activation_bytes(S, B, H, A, "bf16", parallel) * t == layer_activation_bytes(
            S, B, H, A, "bf16")


def test_plain_tp_keeps_the_ten_sbh_outside_the_region_whole():
    # Korthikanti et al. eq. 2 at bf16: sbh(10 + 24/t + 5as/(ht))
    sbh = S * B * H
    got = parallel_layer_activation_bytes(S, B, H, A, "bf16", ModelParallel(tensor=4))
    assert got == 10 * sbh + 24 * sbh // 4 + 5 * A * S * S * B // 4


def test_ulysses_divides_everything_but_the_logits_by_s():
    parallel = ModelParallel(sequence=4)
    layers = parallel_activation_bytes(32, H, A, None, **ONE_SEQUENCE, recompute="none", parallel=parallel)
    assert layers * 4 == 32 * layer_activation_bytes(S, B, H, A, "bf16")
    with_logits = parallel_activation_bytes(32, H, A, 32000, **ONE_SEQUENCE, recompute="none", parallel=parallel)
    assert with_logits - layers == 4 * S * B * 32000  # the sequence is whole again before the output layer


def test_ulysses_with_tensor_parallelism_divides_the_layers_by_both():
    sbh = S * B * H
    got = parallel_layer_activation_bytes(S, B, H, A, "bf16", ModelParallel(tensor=2, sequence=2))
    assert got == (10 * sbh + 24 * sbh // 2 + 5 * A * S * S * B // 2) // 2


def test_vocabulary_parallel_logits_fall_by_t():
    parallel = ModelParallel(tensor=2, megatron_sp=True)
    layers = parallel_activation_bytes(32, H, A, None, **ONE_SEQUENCE, recompute="full", parallel=parallel)
    with_logits = parallel_activation_bytes(32, H, A, 32000, **ONE_SEQUENCE, recompute="full", parallel=parallel)
    assert with_logits - layers == 4 * S * B * 32000 // 2


def test_model_states_are_zero_over_gpus_per_t_of_the_tensor_shard():
    shape = preset_shape("llama-7b")
    result = estimate(shape, Hardware(8), seq_len=2048, parallel=ModelParallel(tensor=2, megatron_sp=True))
    replicated = (2 * 32 + 1) * 4096
    local = -(-(shape.num_params - replicated) // 2) + replicated
    assert result.params_per_rank == local and result.zero_ranks == 4
    for stage in (1, 2, 3):
        assert result.option(stage).per_rank == placed_model_state_bytes(local, 4, stage)


def test_suggests_the_smallest_tensor_size_that_fits_without_offload():
    result = estimate(preset_shape("llama-7b"), Hardware(4), micro_batch=4, seq_len=8192)
    assert result.recommendation.label == "stage 3 + optimizer→cpu, full recomputation"
    suggestion = result.tensor_suggestion
    assert suggestion.parallel == ModelParallel(tensor=2, megatron_sp=True)
    assert suggestion.recommendation.label == "stage 1, full recomputation"
    text = "\n".join(result.explanation)
    assert "ZeRO alone needs optimizer→cpu. Inside a node, --tp 2 --megatron-sp" in text
    assert "⌈(6,738,415,616 − 266,240) / 2⌉ + 266,240 = 3,369,340,928 per tensor rank" in text
    assert "N = GPUs / T = 4 / 2 = 2 ranks" in text
    assert "Recommended at T = 2: stage 1, full recomputation." in text


def test_no_suggestion_when_zero_alone_fits():
    result = estimate(preset_shape("gpt2"), Hardware(1), seq_len=1024)
    assert result.recommendation.option.offload.label == "none"
    assert result.tensor_suggestion is None


def test_no_suggestion_beyond_one_node():
    # 70B on 8 GPUs: ZeRO-3 already spreads the states over every GPU; T moves them, not shrinks them
    result = estimate(preset_shape("llama-70b"), Hardware(8), seq_len=2048)
    assert result.recommendation is None and result.tensor_suggestion is None


def test_cli_takes_tp_and_prints_the_tensor_layout(capsys):
    code, out, _ = run_estimate(["--preset", "llama-7b", "--gpus", "8", "--tp", "2", "--megatron-sp"], capsys)
    assert code == 0
    assert "T = 2 tensor-parallel ranks with Megatron sequence parallelism × N = 4 ZeRO ranks" in " ".join(out.split())
    assert table_rows(out)[("1", "none")][0] == "23.6 GB"  # (2 + 2 + 12/4) × 3,369,340,928


@pytest.mark.parametrize("argv, message", [
    (["--tp", "3"], "--tp 3 does not divide --gpus 8"),
    (["--tp", "2", "--sp", "2", "--megatron-sp"], "Ulysses sequence parallelism (size 2) with Megatron sequence"),
    (["--tp", "8", "--sp", "8", "--gpus", "64"], "--tp × --sp 64 does not divide the 32 attention heads"),
    (["--megatron-sp"], "Megatron sequence parallelism splits the sequence over the tensor group: it needs"),
    (["--sp", "8", "--seq-len", "100"], "--seq-len 100 does not split over 8 sequence ranks"),
])
def test_cli_errors(argv, message, capsys):
    code, _, err = run_estimate(["--preset", "llama-7b", "--gpus", "8", *argv], capsys)
    assert code == 2 and message in err
