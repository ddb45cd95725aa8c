"""Formulas per layer and per parallel layout, beside the model-state ones in formulas.py:
the stage-3 gather buffer, activation bytes per layer and per model (the estimator's
view of shardwise/formulas/activation.py), the tensor-parallel parameter count per rank, and the
pipeline's bubble and micro-batches in flight. The estimator, the main job's report and
the tests share them."""

from __future__ import annotations

from shardwise.formulas.activation import (
    LayerShape,
    activation_peak_bytes,
    selective_kept_bytes,
)
from shardwise.formulas.memory import RECOMPUTE_MODES, RecomputeMode, element_bytes

# Korthikanti et al. assume logits are turned into an fp32 log-softmax that cross-entropy
# keeps for its backward; layer recomputation does not cover it.
LOGITS_BYTES = 4


def stage3_gather_bytes(largest_layer_params: int, dtype: str) -> int:
    """GPU working set of stage 3, whatever is offloaded: the running layer's parameters
    gathered in full, the next layer's prefetched beside them, and in backward the layer's
    full gradient before it is reduce-scattered: (2 + 1) elements per layer parameter."""
    return 3 * element_bytes(dtype) * largest_layer_params


def layer_activation_coefficients(dtype: str) -> tuple[int, int]:
    """(c_h, c_a) in per-layer activation bytes = c_h·s·b·h + c_a·a·s²·b.

    Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
    Models") count what a GPT block saves for backward with e-byte activations and 1-byte
    dropout masks: attention 5e·sbh + sbh (mask) plus (2e + 1)·a·s²·b (scores, softmax,
    its dropout mask); MLP 9e·sbh + sbh; two layer norms 2e·sbh. With e = 2 this is their
    sbh(34 + 5as/h). A llama block has no dropout and a gated MLP with I ≈ 8h/3 saving
    three I-wide tensors, within a few percent of the same total.
    """
    e = element_bytes(dtype)
    return 16 * e + 2, 2 * e + 1


def layer_activation_bytes(seq_len: int, micro_batch: int, hidden: int, heads: int, dtype: str, attention_core: bool = True) -> int:
    """Bytes one transformer layer keeps for backward. Selective recomputation (and flash
    attention) drops the a·s²·b attention-core terms by recomputing them."""
    c_h, c_a = layer_activation_coefficients(dtype)
    linear_part = c_h * seq_len * micro_batch * hidden
    return linear_part + (c_a * heads * seq_len * seq_len * micro_batch if attention_core else 0)


def activation_bytes(
    num_layers: int,
    hidden: int,
    heads: int,
    vocab_size: int | None,
    *,
    seq_len: int,
    micro_batch: int,
    dtype: str,
    recompute: RecomputeMode,
) -> int:
    """Activation bytes per GPU at the peak of backward (start of backward).

    none: every layer's full activations. selective and full are shardwise's policies of
    the same names, by the formulas its measured bytes are tested against
    (shardwise.formulas.activation.activation_peak_bytes): every layer keeps its input (e·s·b·h),
    selective also its linear layers' outputs (9e·s·b·h), and backward brings back one
    layer's full activations at a time while the layers below it are still kept:
    (L − 1)·kept + one layer. Plus the fp32 log-softmax of the logits (4·s·b·V) when the
    vocabulary is known.
    """
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
    for name, value in (("num_layers", num_layers), ("hidden", hidden), ("heads", heads), ("seq_len", seq_len), ("micro_batch", micro_batch)):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if recompute == "none":
        layers = num_layers * layer_activation_bytes(seq_len, micro_batch, hidden, heads, dtype)
    else:
        layer = LayerShape(seq_len, micro_batch, hidden, heads, element_bytes(dtype))
        cached = selective_kept_bytes(layer) if recompute == "selective" else 0
        layers = activation_peak_bytes(layer, num_layers, [range(i, i + 1) for i in range(num_layers)],
                                       cached_per_layer=cached)
    logits = LOGITS_BYTES * seq_len * micro_batch * vocab_size if vocab_size else 0
    return layers + logits


def tensor_parallel_params(sharded_params: int, replicated_params: int, tensor_size: int) -> int:
    """Parameters one tensor-parallel rank holds before ZeRO partitions them: a 1/T block of
    every split parameter (attention and MLP matrices, their column biases, embedding and
    output rows) and the whole of every replicated one (norms, row-parallel biases,
    position embeddings). ZeRO's formulas then apply with this Ψ and N = the data-parallel
    (shard) group; memory_breakdown() reports these local shards."""
    if sharded_params % tensor_size:
        raise ValueError(f"{sharded_params} split parameters do not divide over a tensor group of {tensor_size}")
    return sharded_params // tensor_size + replicated_params


def pipeline_bubble_fraction(size: int, micro_batches: int, virtual: int = 1) -> float:
    """Idle share of each rank's step time with equal stage costs: (p−1)/(m+p−1) for GPipe
    and 1F1B (the pipeline fills and drains once), (p−1)/(v·m+p−1) interleaved (each of the
    v chunks costs 1/v of a stage, so filling and draining take 1/v as long relative to
    the work)."""
    if size < 1 or micro_batches < 1 or virtual < 1:
        raise ValueError(f"size, micro_batches and virtual must be positive, got {size}, {micro_batches}, {virtual}")
    return (size - 1) / (virtual * micro_batches + size - 1)


def pipeline_micro_batches_in_flight(schedule: str, size: int, micro_batches: int, rank: int = 0,
                                     virtual: int = 1) -> int:
    """How many micro-batches' activations a rank holds at its peak (per chunk pass):
    GPipe all m before the first backward; 1F1B p − rank (at most m), so stage 0 holds p;
    interleaved the warm-up forwards plus one, 2(p − rank − 1) + (v − 1)·p + 1 chunk passes.
    Peak activation memory is this times one micro-batch's activations of one chunk."""
    if schedule == "gpipe":
        return micro_batches
    if schedule == "1f1b":
        return min(size - rank, micro_batches)
    if schedule == "interleaved":
        return min(2 * (size - rank - 1) + (virtual - 1) * size + 1, virtual * micro_batches)
    raise ValueError(f"unknown pipeline schedule {schedule!r}: gpipe, 1f1b or interleaved")
