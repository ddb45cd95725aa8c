"""Block quantization of what a collective carries (C28: ZeRO++'s qwZ and qgZ).

One scale for a whole tensor lets its largest element decide every element's precision;
ZeRO++ (Wang et al., 2023) quantizes in blocks instead, each block of `block` elements
with its own scale, so an outlier costs precision only in its own block. Symmetric, as
DeepSpeed's quantizer: per block s = max|x| / q_max and code = round(x / s) in
[−q_max, q_max] (q_max = 127 for int8, 7 for int4), and x ≈ code · s on arrival.

What travels is a *frame* per row: the codes (int8 one per byte; int4 two per byte, low
nibble first, stored as code + 8), padded to a multiple of 8 elements, then one fp32 scale
per block. A row of n elements takes

    frame_bytes(n) = ⌈n/8⌉·bits + 4·⌈n/block⌉

bytes (docs/formulas.md#zero-bytes-between-nodes). Quantizing and dequantizing are
elementwise in fp32, so every process computes the same bits from the same input: a
received value equals a single-process `dequantize(quantize(x))` exactly.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4  # one fp32 scale per block
INT4_OFFSET = 8  # int4 codes -7..7 are stored as 1..15


def padded_elements(numel: int) -> int:
    """Codes are stored for a multiple of 8 elements, so every payload is whole 4-byte words."""
    return -(-numel // 8) * 8


def frame_bytes(numel: int, *, block: int, bits: int) -> int:
    """Bytes of one quantized row of `numel` elements: codes, then one scale per block."""
    return padded_elements(numel) * bits // 8 + SCALE_BYTES * -(-numel // block)


def quantize(rows: torch.Tensor, *, block: int, bits: int) -> torch.Tensor:
    """Frames (uint8, one row each) of the 2-D `rows`, each quantized in blocks of `block`."""
    _check_bits(bits)
    count, numel = rows.shape
    blocks = -(-numel // block)
    width = max(blocks * block, padded_elements(numel))
    values = torch.zeros(count, width, dtype=torch.float32, device=rows.device)
    values[:, :numel] = rows
    by_block = values[:, : blocks * block].view(count, blocks, block)
    limit = 2 ** (bits - 1) - 1
    scales = by_block.abs().amax(dim=2) / limit
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales))
    values[:, : blocks * block] = torch.round(by_block / divisor.unsqueeze(2)).view(count, blocks * block)
    codes = values[:, : padded_elements(numel)].clamp_(-limit, limit).to(torch.int8)
    if bits == 8:
        payload = codes.view(torch.uint8)
    else:
        stored = (codes + INT4_OFFSET).to(torch.uint8)
        payload = stored[:, 0::2] | (stored[:, 1::2] << 4)
    return torch.cat([payload, scales.view(torch.uint8).view(count, blocks * SCALE_BYTES)], dim=1)


def dequantize(frames: torch.Tensor, *, numel: int, block: int, bits: int) -> torch.Tensor:
    """The fp32 rows (count, numel) that `quantize` framed."""
    _check_bits(bits)
    count = frames.shape[0]
    blocks = -(-numel // block)
    payload_bytes = padded_elements(numel) * bits // 8
    payload = frames[:, :payload_bytes]
    scales = frames[:, payload_bytes:].contiguous().view(torch.float32)
    if bits == 8:
        codes = payload.contiguous().view(torch.int8).to(torch.float32)
    else:
        low = (payload & 15).to(torch.float32) - INT4_OFFSET
        high = (payload >> 4).to(torch.float32) - INT4_OFFSET
        codes = torch.stack([low, high], dim=2).view(count, -1)
    values = torch.zeros(count, blocks * block, dtype=torch.float32, device=frames.device)
    values[:, :numel] = codes[:, :numel]
    return (values.view(count, blocks, block) * scales.unsqueeze(2)).view(count, -1)[:, :numel]


def sum_rows(rows: torch.Tensor) -> torch.Tensor:
    """Rows added first to last in fp32: one order, the same in every process."""
    total = rows[0].to(torch.float32, copy=True)
    for row in rows[1:]:
        total += row
    return total


def _check_bits(bits: int) -> None:
    if bits not in (4, 8):
        raise ValueError(f"block quantization stores int8 or int4 codes, not {bits} bits")
