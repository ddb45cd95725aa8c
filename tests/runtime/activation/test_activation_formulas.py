"""Measured activation bytes (saved-tensor hooks) equal the planner's formulas within 10%
on shardwise's GPT, and the √n policy's activation memory grows as √n."""

import math

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from shardwise.runtime.activation import RecomputePolicy
from shardwise.formulas.activation import (
    LayerShape,
    activation_peak_bytes,
    checkpoint_bytes,
    korthikanti_bytes,
    layer_activation_bytes,
    selective_kept_bytes,
)
from tests.runtime.activation.workers import measure, tiny_gpt, with_policy

ROWS, SEQ, HIDDEN, HEADS = 2, 16, 64, 2  # tiny_gpt has 2 heads


def gpt(n_layer: int, dropout: float = 0.0, dtype: torch.dtype = torch.float32):
    return tiny_gpt(n_layer=n_layer, dropout=dropout, n_embd=HIDDEN).to(dtype)


def per_layer(policy: str, dropout: float = 0.0, dtype: torch.dtype = torch.float32, kind: str = "total") -> float:
    """Bytes one more layer adds: the difference between 4 and 2 layers, halved."""
    peaks = [measure(with_policy(gpt(n, dropout, dtype), policy))[2].breakdown()[kind] for n in (2, 4)]
    return (peaks[1] - peaks[0]) / 2


def close(measured: float, formula: float) -> bool:
    return abs(measured - formula) <= 0.1 * formula


def shape(**changes) -> LayerShape:
    return LayerShape(SEQ, ROWS, HIDDEN, HEADS, **changes)


def test_korthikanti_16_bit_figures():
    s, b, h, a = 2048, 1, 4096, 32
    assert korthikanti_bytes(s, b, h, a) == s * b * h * (34 + 5 * a * s // h)
    assert korthikanti_bytes(s, b, h, a, 8) == s * b * h * 10 + s * b * h * (24 + 5 * a * s // h) // 8
    assert korthikanti_bytes(s, b, h, a, 8, True) == s * b * h * (34 + 5 * a * s // h) // 8


@pytest.mark.parametrize(("dtype", "e"), [(torch.float32, 4), (torch.bfloat16, 2)])
def test_no_recomputation_fused_attention(dtype, e):
    measured = per_layer("none", dtype=dtype)
    formula = layer_activation_bytes(shape(element_bytes=e, dropout=False, attention_core=False))
    assert close(measured, formula), (measured, formula)


def test_no_recomputation_with_attention_core_and_dropout():
    """The math attention keeps its a·s² scores (here as·s²b = 8·sbh); CPU dropout keeps
    fp32 masks (m = e). GPT has no attention-output dropout: one sbh mask less."""
    seq = 128
    with sdpa_kernel(SDPBackend.MATH):
        peaks = [measure(with_policy(tiny_gpt(n, 0.1, HIDDEN, seq), "none"), seq=seq)[2].breakdown()["total"]
                 for n in (1, 2)]
    formula = layer_activation_bytes(LayerShape(seq, ROWS, HIDDEN, HEADS, element_bytes=4, mask_bytes=4))
    assert close(peaks[1] - peaks[0], formula), (peaks, formula)


@pytest.mark.parametrize("policy", ["full", "every_k", "sqrt"])
def test_checkpoints_and_recomputation_working_set(policy):
    layers = 6
    layer = shape(element_bytes=4, dropout=False, attention_core=False)
    tracker = measure(with_policy(gpt(layers), policy))[2]
    regions = RecomputePolicy(policy).regions(layers)
    assert tracker.breakdown()["checkpoints"] == len(regions) * checkpoint_bytes(layer)  # the inputs, exactly
    longest = max(len(region) for region in regions)
    working = longest * layer_activation_bytes(layer) - checkpoint_bytes(layer)
    assert close(tracker.breakdown()["recompute"], working), (tracker.breakdown(), working)
    # the peak lies between the layers' formula and the formula plus what the rest of the
    # model keeps (embeddings, logits: freed before a recomputation, held at forward's end)
    outside = tracker.breakdown()["saved"] - (layers - sum(map(len, regions))) * layer_activation_bytes(layer)
    formula = activation_peak_bytes(layer, layers, regions)
    assert formula <= tracker.breakdown()["total"] <= 1.1 * (formula + outside), (tracker.breakdown(), formula)


def test_full_recomputation_keeps_layer_inputs_only():
    assert per_layer("full", kind="checkpoints") == checkpoint_bytes(shape(element_bytes=4))


@pytest.mark.parametrize("rule", ["linear_outputs", "widening_matmuls"])
def test_selective_keeps_the_linear_outputs_of_its_rule(rule):
    peaks = [measure(with_policy(gpt(n), "selective", selective=rule))[2].breakdown()["checkpoints"] for n in (2, 4)]
    layer = shape(element_bytes=4)
    assert (peaks[1] - peaks[0]) // 2 == checkpoint_bytes(layer) + selective_kept_bytes(layer, rule)


def test_selective_keeps_less_than_half_with_the_attention_core():
    """With dropout the CPU attention runs unfused and keeps its a·s² scores; at a·s/h = 4
    (the 25M benchmark's 8·256/512) a layer keeps 116 sbh bytes in fp32 without
    recomputation, the default selective rule 10·4 of them."""
    seq = 128
    with sdpa_kernel(SDPBackend.MATH):
        kept, whole = ([measure(with_policy(tiny_gpt(n, 0.1, HIDDEN, seq), policy), seq=seq)[2].breakdown()[kind]
                        for n in (1, 2)] for policy, kind in (("selective", "checkpoints"), ("none", "total")))
    assert kept[1] - kept[0] <= 0.5 * (whole[1] - whole[0]), (kept, whole)


def test_sqrt_policy_grows_as_square_root_of_layers():
    counts = [4, 16, 64]
    peaks = []
    for n in counts:
        model = with_policy(tiny_gpt(n_layer=n, dropout=0.0, n_embd=16, seq=8), "sqrt")
        peaks.append(measure(model, seq=8)[2].breakdown()["total"])
    xs, ys = [math.log(n) for n in counts], [math.log(p) for p in peaks]
    mean_x, mean_y = sum(xs) / 3, sum(ys) / 3
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
    assert 0.4 <= slope <= 0.6, (peaks, slope)
