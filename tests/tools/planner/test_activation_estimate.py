"""`shardwise estimate` counts activations with the formulas shardwise's measured bytes are
tested against (shardwise/formulas/activation.py), prints that arithmetic, and recommends a
recomputation policy by its config key."""

import pytest

from shardwise.formulas.activation import LayerShape, activation_peak_bytes, selective_kept_bytes
from shardwise.formulas.parallel_activation import ModelParallel
from shardwise.tools.planner.recommend import Hardware, estimate
from shardwise.formulas.model_shape import ModelShape
from shardwise.models.shapes import preset_shape

S, B = 1024, 2


def substituted(line: str) -> float:
    """The value of an explanation line's middle part, "symbols = numbers = result"."""
    numbers = line.split(" = ")[1]
    return eval(numbers.replace("×", "*").replace("−", "-"), {"__builtins__": {}})  # digits and + - * / ( )


@pytest.mark.parametrize("parallel", [ModelParallel(), ModelParallel(tensor=2), ModelParallel(tensor=2, megatron_sp=True)],
                         ids=["plain", "tp2", "tp2-sp"])
def test_printed_arithmetic_evaluates_to_the_estimate(parallel):
    result = estimate(preset_shape("llama-7b"), Hardware(4), B, S, parallel=parallel)
    for mode in ("none", "selective", "full"):
        line = next(text for text in result.explanation if text.lstrip().startswith(f"{mode}: "))
        assert substituted(line) == pytest.approx(result.activations[mode], rel=1e-6), line


def test_selective_and_full_are_the_engines_peak_formula():
    shape = preset_shape("gpt2")
    result = estimate(shape, Hardware(1, gpu_memory_gb=80), B, S, dtype="bf16")
    layer = LayerShape(S, B, shape.hidden_size, shape.num_heads, element_bytes=2)
    regions = [range(i, i + 1) for i in range(shape.num_layers)]
    logits = 4 * S * B * shape.vocab_size
    assert result.activations["full"] == activation_peak_bytes(layer, shape.num_layers, regions) + logits
    cached = selective_kept_bytes(layer)
    assert cached == 9 * 2 * S * B * shape.hidden_size
    assert result.activations["selective"] == activation_peak_bytes(layer, shape.num_layers, regions,
                                                                    cached_per_layer=cached) + logits
    assert result.activations["full"] < result.activations["selective"] < result.activations["none"]


def test_recommendation_names_the_policy_key():
    # gpt2-xl, s = 1024, b = 8 on one 40 GB GPU: stage 0 holds 16Ψ = 25 GB of model states,
    # which leaves room for selective's activations but not for all of them
    result = estimate(preset_shape("gpt2-xl"), Hardware(1, gpu_memory_gb=40), 8, 1024)
    recommendation = result.recommendation
    assert recommendation is not None and recommendation.recompute != "none"
    line = next(text for text in result.explanation if text.startswith("Recommended:"))
    assert line.endswith(f'Config: "activation_checkpointing": {{"policy": "{recommendation.recompute}"}}.')
    plain = estimate(preset_shape("gpt2"), Hardware(8), 1, 512)
    assert plain.recommendation.recompute == "none"
    assert "activation_checkpointing" not in next(t for t in plain.explanation if t.startswith("Recommended:"))
