"""Activation bytes of the regions Megatron sequence parallelism shards (issue 10 item 3).

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
