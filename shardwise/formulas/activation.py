"""Activation formulas: bytes a transformer layer keeps for backward, and the peak of a
recomputation policy (the ZeRO formulas' neighbours in formulas.py; integer arithmetic).

Per layer, s sequence, b micro-batch, h hidden, a heads, e bytes per activation element,
m bytes per dropout-mask element, t tensor-parallel ranks (Korthikanti et al., 2022,
"Reducing Activation Recomputation in Large Transformer Models"):

    linear terms   16e·sbh + 2m·sbh: QKV input e, Q K V 3e, attention output e, MLP input e,
                   GeLU input 4e and output 4e, two layer-norm inputs 2e (16e); the attention-
                   output and MLP dropout masks (2m). With e = 2 and m = 1: 34·sbh.
    attention core (2e + m)·as²b: softmax output, its dropout mask and output; without
                   dropout e·as²b. Fused ("flash") attention keeps none of it (it keeps its
                   O(sb·a) log-sum-exp), nor does selective recomputation.

so sbh(34 + 5as/h) in 16-bit with fused GPU dropout (1-byte masks). On CPU, dropout keeps its
mask in the activation dtype (m = e). With tensor parallelism the Q K V, attention-output
and MLP terms (12e) and the core are split over t, the rest replicated:
sbh(10 + 24/t + 5as/(ht)); Megatron sequence parallelism (or Pa for what is kept) splits
everything: sbh(34 + 5as/h)/t.

A checkpointed region keeps only its input, e·sbh (/t with Pa or SP), and its
recomputation brings one region's activations back at a time (activation_peak_bytes).
Selective recomputation (shardwise/runtime/activation/selective.py) also keeps linear-layer
outputs: all four ("linear_outputs", the default: QKV 3, attention projection 1, MLP up 4
and down 1, 9e·sbh) or the widening ones ("widening_matmuls": QKV and MLP up, 7e·sbh);
under tensor parallelism the column-parallel outputs (QKV, MLP up) are split over t and
the row-parallel ones (partial sums before their all-reduce) are h wide on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LayerShape:
    """One transformer layer's activation sizes: sequence, micro-batch, hidden, heads."""

    seq_len: int
    micro_batch: int
    hidden: int
    heads: int
    element_bytes: int = 2
    mask_bytes: int = 1
    dropout: bool = True
    attention_core: bool = True  # False: fused attention, no a·s² terms
    tensor_parallel: int = 1
    sequence_parallel: bool = False  # Megatron SP: every term split over t

    @property
    def sbh(self) -> int:
        return self.seq_len * self.micro_batch * self.hidden


def layer_activation_bytes(layer: LayerShape) -> int:
    """Bytes one layer keeps for backward without recomputation (Korthikanti et al.)."""
    e, m = layer.element_bytes, (layer.mask_bytes if layer.dropout else 0)
    t = layer.tensor_parallel
    replicated = (4 * e + 2 * m) * layer.sbh  # layer-norm inputs, QKV and MLP inputs, masks
    split = 12 * e * layer.sbh  # Q K V, attention output, GeLU input and output
    core = 0
    if layer.attention_core:
        core = ((2 * e + m) if layer.dropout else e) * layer.heads * layer.seq_len ** 2 * layer.micro_batch
    if layer.sequence_parallel:
        return (replicated + split + core) // t
    return replicated + (split + core) // t


def korthikanti_bytes(seq_len: int, micro_batch: int, hidden: int, heads: int, tensor_parallel: int = 1,
                      sequence_parallel: bool = False) -> int:
    """The paper's 16-bit figure: sbh(34 + 5as/h), sbh(10 + 24/t + 5as/(ht)) with TP,
    sbh(34 + 5as/h)/t with TP and SP."""
    return layer_activation_bytes(LayerShape(seq_len, micro_batch, hidden, heads, 2, 1, True, True,
                                             tensor_parallel, sequence_parallel))


# (column-parallel widths, row-parallel widths) of the linear outputs a selective rule keeps, in h
SELECTIVE_KEPT_WIDTHS = {"linear_outputs": (7, 2), "widening_matmuls": (7, 0)}


def selective_kept_bytes(layer: LayerShape, rule: str = "linear_outputs") -> int:
    """Bytes of operator outputs one selectively checkpointed layer keeps besides its input."""
    if rule not in SELECTIVE_KEPT_WIDTHS:
        raise ValueError(f"no formula for selective rule {rule!r}; known: {sorted(SELECTIVE_KEPT_WIDTHS)}")
    column, row = SELECTIVE_KEPT_WIDTHS[rule]
    return layer.element_bytes * (layer.sbh * column // layer.tensor_parallel + layer.sbh * row)


def checkpoint_bytes(layer: LayerShape, partitioned: bool = False) -> int:
    """What a checkpointed layer keeps: its input, split over t with Pa or SP."""
    whole = layer.element_bytes * layer.sbh
    return whole // layer.tensor_parallel if partitioned or layer.sequence_parallel else whole


def head_bytes(layer: LayerShape, vocab_size: int) -> int:
    """What a GPT keeps for backward after its layers: the final norm's and the output
    layer's inputs (2e·sbh) and the fp32 log-softmax of the logits (4·sbV); freed when
    backward reaches the layers, so it counts only at the end of forward."""
    return 2 * layer.element_bytes * layer.sbh + 4 * layer.seq_len * layer.micro_batch * vocab_size


def activation_peak_bytes(
    layer: LayerShape,
    num_layers: int,
    regions: list[range],
    partitioned: bool = False,
    cached_per_layer: int = 0,
    outside: int = 0,
) -> int:
    """Peak bytes the layers keep under a policy's `regions` (RecomputePolicy.regions):
    the larger of the end of forward (unchecked layers whole, each region its input and
    `cached_per_layer` bytes per layer for selective, plus `outside`, e.g. head_bytes) and
    each region's recomputation in backward (the layers and regions below it still kept,
    the region brought back whole). Without Pa, a recomputed region's first layer-norm
    input is the kept input itself (1/t of it with sequence parallelism)."""
    full = layer_activation_bytes(layer)
    kept = checkpoint_bytes(layer, partitioned)
    start_of = {region.start: region for region in regions}
    covered = {index for region in regions for index in region}

    def held_below(position: int) -> int:
        """Bytes kept by the layers before `position` at the end of forward."""
        held = sum(full for index in range(position) if index not in covered)
        return held + sum(kept + cached_per_layer * len(region) for start, region in start_of.items() if start < position)

    peak = held_below(num_layers) + outside
    for region in regions:
        recomputed = len(region) * full - (0 if partitioned else kept)
        peak = max(peak, held_below(region.start) + kept + recomputed)
    return peak
