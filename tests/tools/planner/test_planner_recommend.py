"""Recommendations: fastest option that fits, with recomputation only when needed."""

import pytest

from shardwise.tools.planner import Hardware, ModelShape, Offload, estimate
from shardwise.formulas.layers import activation_bytes
from shardwise.tools.planner.recommend import preference_order
from shardwise.models.shapes import preset_shape

LLAMA_70B_PARAMS = 68_976_648_192
LLAMA_70B_BLOCK = 855_654_400


def test_small_model_gets_plain_data_parallelism() -> None:
    shape = preset_shape("gpt2")
    result = estimate(shape, Hardware(1), micro_batch=1, seq_len=1024)
    recommendation = result.recommendation
    assert recommendation is not None
    assert (recommendation.option.stage, recommendation.option.offload, recommendation.recompute) == (0, Offload(), "none")
    activations = activation_bytes(12, 768, 12, 50257, seq_len=1024, micro_batch=1, dtype="bf16",
                                   recompute="none")
    assert recommendation.gpu_bytes == 16 * shape.num_params + activations
    assert result.ruled_out == ()


def test_paper_model_on_64_gpus_needs_stage_1() -> None:
    result = estimate(ModelShape.from_params(7.5e9), Hardware(64))
    assert result.activations is None
    assert [o.gpu_model_states for o in result.options if o.offload == Offload()] == [
        120_000_000_000, 31_406_250_000, 16_640_625_000, 1_875_000_000
    ]
    assert result.recommendation is not None and result.recommendation.label == "stage 1, no recomputation"
    assert [o.label for o in result.ruled_out] == ["stage 0"]
    text = "\n".join(result.explanation)
    assert "2 × 7.5e9 + 2 × 7.5e9 + 12 × 7.5e9 / 64 = 31.4 GB" in text
    assert "stage 0: GPU needs at least 120 GB > 68.0 GB usable" in text
    assert "Activations not counted" in text


def test_llama_70b_on_8x80gb_does_not_fit_with_512gb_hosts() -> None:
    result = estimate(preset_shape("llama-70b"), Hardware(8), micro_batch=1, seq_len=2048)
    assert result.recommendation is None
    assert result.option(3).shortfall == "gpu"
    # 8 ranks × (4 + 12)Ψ/8 = 16Ψ = 1104 GB of host memory > 512 × 0.85
    assert result.option(3, Offload("cpu")).cpu_per_node == 16 * LLAMA_70B_PARAMS
    assert result.option(3, Offload("cpu")).shortfall == "cpu"
    assert result.option(3, Offload("nvme")).shortfall == "nvme"
    assert any(line.startswith("Nothing fits") for line in result.explanation)


def test_llama_70b_on_8x80gb_fits_with_cpu_optimizer_and_selective_recomputation() -> None:
    result = estimate(preset_shape("llama-70b"), Hardware(8, cpu_memory_gb=2048), micro_batch=1, seq_len=2048)
    recommendation = result.recommendation
    assert recommendation is not None
    assert (recommendation.option.stage, recommendation.option.offload) == (3, Offload("cpu"))
    assert recommendation.recompute == "selective"
    s, b, h, a, layers, vocab = 2048, 1, 8192, 64, 80, 32000
    # every layer keeps its input and its linear outputs (1 + 9 widths of h, 2 bytes), one comes back whole
    selective = (layers - 1) * 2 * (1 + 9) * s * b * h + s * b * h * (34 + 5 * a * s // h) + 4 * s * b * vocab
    assert recommendation.gpu_bytes == 2 * LLAMA_70B_PARAMS // 8 + 3 * 2 * LLAMA_70B_BLOCK + selective
    assert recommendation.option.fitting_modes == ("selective", "full")
    text = "\n".join(result.explanation)
    assert ('Recommended: stage 3 + optimizer→cpu, selective recomputation. Config: "activation_checkpointing": '
            '{"policy": "selective"}.') in text
    assert "8 × (4 × 68,976,648,192 / 8 + 12 × 68,976,648,192 / 8) = 1104 GB ≤ 1741 GB usable" in text


def test_llama_70b_with_nvme_offloads_optimizer_to_nvme() -> None:
    result = estimate(preset_shape("llama-70b"), Hardware(8, nvme_gb=4000))
    assert result.recommendation is not None
    assert result.recommendation.label == "stage 3 + optimizer→nvme, selective recomputation"
    assert result.recommendation.option.nvme_per_node == 12 * LLAMA_70B_PARAMS


def test_lower_stage_is_not_given_up_for_recomputation_among_equal_traffic_stages() -> None:
    # llama-7b on 4 x 80 GB: stage 1 fits only with selective recomputation, stage 2 without
    result = estimate(preset_shape("llama-7b"), Hardware(4), micro_batch=1, seq_len=2048)
    assert result.option(1).fits_with == "selective"
    assert result.recommendation is not None and result.recommendation.label == "stage 2, no recomputation"
    assert [o.label for o in result.ruled_out] == ["stage 0", "stage 1"]


def test_preference_order() -> None:
    order = [(stage, offload.label, mode) for (stage, offload), mode in preference_order(("none", "selective", "full"))]
    assert order[:7] == [
        (0, "none", "none"), (1, "none", "none"), (2, "none", "none"),
        (0, "none", "selective"), (1, "none", "selective"), (2, "none", "selective"),
        (0, "none", "full"),
    ]
    assert order[9:13] == [(3, "none", "none"), (3, "none", "selective"), (3, "none", "full"), (2, "optimizer→cpu", "none")]
    assert order[-1] == (3, "optimizer+params→nvme", "full")
    assert (1, "optimizer→cpu", "none") not in order


def test_headroom_is_applied() -> None:
    assert Hardware(1, gpu_memory_gb=80, headroom=0.1).usable_bytes("gpu") == 72_000_000_000
    # llama-7b on 8 x 80 GB: stage 1 needs 67.9 GB, under 68 GB at 15% headroom, over 64 GB at 20%
    shape = preset_shape("llama-7b")
    assert estimate(shape, Hardware(8)).recommendation.label == "stage 1, no recomputation"
    assert estimate(shape, Hardware(8, headroom=0.2)).recommendation.label == "stage 2, no recomputation"


def test_host_memory_counts_ranks_on_the_node() -> None:
    result = estimate(ModelShape.from_params(1e9), Hardware(4, gpus_per_node=8))
    assert result.hardware.ranks_per_node == 4
    assert result.option(2, Offload("cpu")).cpu_per_node == 4 * 16 * 250_000_000


def test_fp32_uses_four_byte_states_and_k_8() -> None:
    result = estimate(ModelShape.from_params(7.5e9), Hardware(64), dtype="fp32")
    assert result.optimizer_state_bytes == 8
    assert result.option(1).gpu_model_states == 60_937_500_000


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_gpus": 0}, "GPU counts must be positive"),
        ({"num_gpus": 8, "gpu_memory_gb": 0}, "gpu_memory_gb must be positive"),
        ({"num_gpus": 8, "nvme_gb": -1}, "must be >= 0"),
        ({"num_gpus": 8, "headroom": 1.0}, r"headroom must be in \[0, 1\)"),
    ],
)
def test_bad_hardware_is_rejected(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Hardware(**kwargs)


def test_bad_training_settings_are_rejected() -> None:
    with pytest.raises(ValueError, match="micro_batch and seq_len must be positive"):
        estimate(preset_shape("gpt2"), Hardware(1), micro_batch=0)
    with pytest.raises(ValueError, match="optimizer must be one of"):
        estimate(preset_shape("gpt2"), Hardware(1), optimizer="rmsprop")
