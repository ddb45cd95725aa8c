"""Activation bytes under tensor and sequence parallelism: how one replica is split
(`ModelParallel`), the per-rank Korthikanti formulas the estimator uses, and the exact bytes
of the regions Megatron sequence parallelism shards in shardwise GPT (issue 10 items 3, 5).

The exact regions:

Per decoder layer of a pre-norm transformer (shardwise GPT's block: norm → attention,
norm → MLP → dropout), with b sequences of s tokens, width h, fp32 activations, T tensor
ranks; s_T = s/T with Megatron sequence parallelism, s without it:

    norms                 2 · 4·b·s_T·(h + 2)   each LayerNorm saves its input (b·s_T·h) and
                                                its mean and 1/std (b·s_T each)
    dropout               m·b·s_T·h             the mask, m bytes per element (torch's CPU
                                                dropout keeps a float mask: m = 4; CUDA's
                                                native dropout a bool one: m = 1)
    column-parallel input 2 · 4·b·s_T·h         what the attention's and the MLP's
                                                column-parallel weight gradients need: the
                                                whole replicated input without SP; with SP
                                                only the sequence shard, gathered again in
                                                backward (parallel/tensor/sequence_gather.py)

Everything else a layer saves sits inside the tensor region (split by heads or by the MLP
width) and is the same with or without sequence parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.formulas.activation import LayerShape, checkpoint_bytes, selective_kept_bytes
from shardwise.formulas.memory import (
    RECOMPUTE_MODES,
    RecomputeMode,
    element_bytes,
)
from shardwise.formulas.layers import LOGITS_BYTES, activation_bytes, layer_activation_coefficients


def sequence_region_activation_bytes(batch: int, seq_len: int, hidden: int, tensor_size: int, layers: int,
                                     sequence_parallel: bool, mask_bytes: int = 4) -> dict[str, int]:
    """Saved bytes of one forward's norm, dropout and column-parallel-input regions."""
    if sequence_parallel and seq_len % tensor_size:
        raise ValueError(f"sequence length {seq_len} does not split over tensor_parallel.size {tensor_size}")
    tokens = batch * (seq_len // tensor_size if sequence_parallel else seq_len)
    return {
        "norm": layers * 2 * 4 * tokens * (hidden + 2),
        "dropout": layers * mask_bytes * tokens * hidden,
        "column_input": layers * 2 * 4 * tokens * hidden,
    }


@dataclass(frozen=True)
class ModelParallel:
    """How one model replica is split: T tensor ranks (Megatron sequence parallelism
    inside them or not) and S Ulysses sequence ranks (which may be combined with T, not
    with Megatron SP). ZeRO shards over the rest: N = GPUs / T (the sequence ranks are
    ZeRO shard ranks too)."""

    tensor: int = 1
    sequence: int = 1
    megatron_sp: bool = False
    pipeline: int = 1  # P stages, each holding 1/P of the layers; ZeRO then shards over GPUs / (T·P)

    def __post_init__(self) -> None:
        if self.tensor <= 0 or self.sequence <= 0 or self.pipeline <= 0:
            raise ValueError(f"tensor, sequence and pipeline sizes must be positive, got {self.tensor}, "
                             f"{self.sequence} and {self.pipeline}")
        if self.megatron_sp and self.sequence > 1:
            raise ValueError(f"Ulysses sequence parallelism (size {self.sequence}) with Megatron sequence "
                             "parallelism: choose one sequence parallelism")
        if self.megatron_sp and self.tensor == 1:
            raise ValueError("Megatron sequence parallelism splits the sequence over the tensor group: it needs a "
                             "tensor-parallel size above 1")


NO_MODEL_PARALLEL = ModelParallel()


def parallel_layer_activation_bytes(seq_len: int, micro_batch: int, hidden: int, heads: int, dtype: str,
                                    parallel: ModelParallel = NO_MODEL_PARALLEL, attention_core: bool = True) -> int:
    """`layer_activation_bytes` on one rank of a tensor (T) or Ulysses (S) group
    (Korthikanti et al. 2022, eq. 2 and 4): of c_h·sbh, the 4e + 2 bytes per sbh outside the
    tensor region (two norm inputs, the two column-parallel inputs, two 1-byte dropout
    masks) stay whole under plain tensor parallelism and fall by T with Megatron sequence
    parallelism; the 12e inside the region and the attention core fall by T. Ulysses
    splits every position-wise tensor by S and the attention core by heads, so all by S.
    Pipeline stages do not change it: under 1F1B the first stage holds P micro-batches in
    flight through its L/P layers, the bytes of one micro-batch through all L layers."""
    c_h, c_a = layer_activation_coefficients(dtype)
    e, t, s_size = element_bytes(dtype), parallel.tensor, parallel.sequence
    sbh = seq_len * micro_batch * hidden
    outside = 4 * e + 2
    if parallel.megatron_sp:
        linear_part = c_h * sbh // t
    else:
        linear_part = outside * sbh + (c_h - outside) * sbh // t
    core = c_a * heads * seq_len * seq_len * micro_batch // t if attention_core else 0
    return (linear_part + core) // s_size


def parallel_activation_bytes(num_layers: int, hidden: int, heads: int, vocab_size: int | None, *,
                              seq_len: int, micro_batch: int, dtype: str, recompute: RecomputeMode,
                              parallel: ModelParallel = NO_MODEL_PARALLEL) -> int:
    """`activation_bytes` on one rank of a tensor or Ulysses group: the layers as in
    `parallel_layer_activation_bytes`; with recomputation each layer keeps its input, split
    by T only with Megatron sequence parallelism and by S with Ulysses, selective also its
    linear outputs (the column-parallel QKV and MLP up-projection split by T, the row-
    parallel outputs h wide; shardwise.formulas.activation.selective_kept_bytes), and backward brings
    one layer back whole: (L − 1)·kept + one layer. The fp32 log-softmax of the logits
    falls by T (the vocabulary-parallel loss never gathers them) but not by S (the sequence
    is whole again after the decoder stack)."""
    if parallel.tensor == parallel.sequence == 1:
        return activation_bytes(num_layers, hidden, heads, vocab_size, seq_len=seq_len, micro_batch=micro_batch,
                                dtype=dtype, recompute=recompute)
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
    layer = parallel_layer_activation_bytes(seq_len, micro_batch, hidden, heads, dtype, parallel)
    if recompute == "none":
        layers = num_layers * layer
    else:
        shape = LayerShape(seq_len, micro_batch, hidden, heads, element_bytes(dtype), tensor_parallel=parallel.tensor,
                           sequence_parallel=parallel.megatron_sp)
        kept = checkpoint_bytes(shape) + (selective_kept_bytes(shape) if recompute == "selective" else 0)
        layers = (num_layers - 1) * kept // parallel.sequence + layer
    logits = LOGITS_BYTES * seq_len * micro_batch * vocab_size // parallel.tensor if vocab_size else 0
    return layers + logits
