"""Block-wise 8-bit quantisation with a dynamic code (Dettmers et al., 2022, "8-bit
Optimizers via Block-wise Quantization"), the state format of 8-bit Adam.

A block of 256 consecutive elements is stored as one fp32 scale, its absolute maximum,
and one byte per element: the index of the code value nearest to element / absmax. The
code is *dynamic*: its values are spread over seven decades (1e-6 .. 1), with more of
them in the larger decades, so small and large entries of a block both keep about two
significant digits, which a linear 8-bit grid would lose for the small ones. Adam's first
moment needs a signed code; its second moment is never negative, so its code spends the
sign bit on finer steps.

Blocks are counted in the *parameter's* flattened coordinates, not the piece's, so that a
piece boundary inside a block leaves the block (and its scale) what it is on one process.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from shardwise.runtime.optim.layout import PaddedRows

BLOCK = 256  # elements per scale, as bitsandbytes' optimizers use
DECADES = 7  # code values span 10^-(DECADES-1) .. 1
TINY_SCALE = 1e-38  # an all-zero block: any positive scale maps it to code 0.0
CELL_SHIFT = 15  # rounding cells keep an fp32's sign, exponent and top 8 mantissa bits


@functools.cache
def dynamic_code(signed: bool) -> torch.Tensor:
    """The 256 code values, sorted: 0 and 1, and in decade k (k = 0 .. 6, values in
    [0.1, 1] x 10^(k-6)) the centres of 2^k equal bins (signed: and their negatives), or
    of 2^(k+1) bins when unsigned. Arithmetic in fp32, so the values equal bitsandbytes'
    `create_dynamic_map` bit for bit."""
    values = [0.0, 1.0]
    for decade in range(DECADES):
        bins = 2**decade if signed else 2 ** (decade + 1)
        edges = torch.linspace(0.1, 1.0, bins + 1)
        centres = (edges[:-1] + edges[1:]) / 2
        scale = 10.0 ** (decade - (DECADES - 1))
        values += (centres * scale).tolist()
        if signed:
            values += (centres * -scale).tolist()
    if len(values) != 256:
        raise AssertionError(f"a dynamic code has 256 values, built {len(values)}")
    return torch.tensor(sorted(values), dtype=torch.float32)


@functools.cache
def _midpoints(signed: bool) -> torch.Tensor:
    code = dynamic_code(signed)
    return (code[:-1] + code[1:]) / 2


class Codebook(NamedTuple):
    """A dynamic code and its rounding table, passed as tensors (so a compiled step takes
    them as inputs rather than building them while it is traced)."""

    values: torch.Tensor  # the 256 code values, sorted
    below: torch.Tensor  # per rounding cell: the code midpoints below the whole cell (uint8)
    boundary: torch.Tensor  # per rounding cell: its one midpoint, or +inf (fp32)

    def to(self, device: torch.device) -> "Codebook":
        return Codebook(*(table.to(device) for table in self))


@functools.cache
def codebook(signed: bool) -> Codebook:
    """Nearest-code lookup by the top bits of an fp32 value, instead of a binary search
    per element (torch.bucketize on a CPU: ~50-100 ns per element, the whole cost of
    8-bit Adam's step before this table).

    An fp32 value's sign, exponent and top mantissa bits (its bits >> CELL_SHIFT) pick a
    *cell*, a contiguous range of values; the code's midpoints are far enough apart that
    a cell holds at most one of them (checked here). So the code index, the number of
    midpoints below x, is (midpoints below the whole cell) + (x > the cell's midpoint),
    +inf standing in where a cell has none: `bucketize` exactly, ties included."""
    midpoints = _midpoints(signed).double()
    cells = torch.arange(1 << (32 - CELL_SHIFT), dtype=torch.int64)
    first = (cells << CELL_SHIFT).to(torch.int32).view(torch.float32).double()
    last = ((cells << CELL_SHIFT) + (1 << CELL_SHIFT) - 1).to(torch.int32).view(torch.float32).double()
    low, high = torch.minimum(first, last), torch.maximum(first, last)  # negative cells run downwards
    low = torch.where(torch.isnan(low), first, low)  # the cells of inf and NaNs: their first value
    below = torch.searchsorted(midpoints, low)  # midpoints < low
    inside = torch.searchsorted(midpoints, high) - below  # midpoints in [low, high)
    finite = torch.isfinite(low) & torch.isfinite(high)
    if int(inside[finite].max()) > 1:
        raise AssertionError(f"CELL_SHIFT {CELL_SHIFT} is too coarse: a cell holds two code midpoints")
    boundary = midpoints[below.clamp(max=midpoints.numel() - 1)].float()
    boundary = torch.where((inside == 1) & finite, boundary, torch.tensor(float("inf")))
    return Codebook(dynamic_code(signed), below.to(torch.uint8), boundary)


# The AVX-512 encoder's constants (`decade_rounding`): the in-decade position is a fixed-point
# number with ROUNDING_FRACTION fractional bits, computed ROUNDING_MARGIN (in bins) high.
ROUNDING_FRACTION = 12
ROUNDING_MARGIN = 2.0**-ROUNDING_FRACTION
ROUNDING_GROUPS = 16  # pairs of binades, [2^(2g-31), 2^(2g-29)): the exponent field >> 1, low 4 bits
ROUNDING_WORDS = 352  # thresholds, bases, slopes, offsets, caps (16 each), 256 midpoints, the sign flag


@functools.cache
def decade_rounding(signed: bool) -> torch.Tensor:
    """The nearest code by arithmetic instead of a table lookup (native_kernels.c,
    `quantize_values_avx512`), as int32 words: on a CPU whose gathers are slow, a lookup per
    element and moment was most of 8-bit Adam's step.

    Counting F(a), the positive midpoints below a = |x| (the code index, up to the sign),
    rests on the code's structure: within decade k the midpoints lie on a uniform grid (the
    centres' bins' edges), so F is `start + floor(slope * a + offset)`, capped at the
    decade's last code; which decade, by comparing a with the one decade threshold (a
    midpoint between decades) that can lie in a's pair of binades, as 16-entry tables
    indexed by the exponent. The fp32 midpoints are off the ideal grid by rounding only
    (about 1e-5 bins, checked here to be under half of ROUNDING_MARGIN), so a position more
    than ROUNDING_MARGIN from an integer is right; a value nearer (about one in two
    thousand) is compared with the midpoint itself, read from the table of midpoints. As
    fp32 rounding is monotone, these checks on the midpoints hold for every value between
    them: the codes equal the table lookup's for every fp32 input (also checked on all 2^32,
    tests/runtime/optim/test_native.py).

    Words: [0, 16) per binade pair its decade threshold (fp32, +inf if none), [16, 32) the
    region below that pair (0: below the first midpoint, k + 1: decade k, DECADES + 1: above
    the last midpoint), then per region [32, 48) slope and [48, 64) offset (fp32, times
    2^ROUNDING_FRACTION, the offset ROUNDING_MARGIN high), [64, 80) its last count, [80, 336)
    the positive midpoints (+inf after them), [336] whether the code is signed."""
    midpoints = _midpoints(signed)
    positive = midpoints[midpoints > 0]
    sizes = [2**decade if signed else 2 ** (decade + 1) for decade in range(DECADES)]
    starts = [1 + sum(sizes[:decade]) for decade in range(DECADES)]
    thresholds = [float(positive[start - 1]) for start in starts] + [float(positive[-1])]
    unit = 2.0**ROUNDING_FRACTION
    slopes, offsets, caps = [0.0], [(0.5 + ROUNDING_MARGIN) * unit], [0]  # below the first midpoint: count 0
    for decade, (size, start) in enumerate(zip(sizes, starts)):
        inner = positive[start : start + size - 1].double()  # the decade's own midpoints: the j-th has count start + j
        counts = torch.arange(start + 1, start + size, dtype=torch.float64)
        slope = size / (0.9 * 10.0 ** (decade - (DECADES - 1))) if size > 1 else 0.0  # bins per unit of value
        offset = float((counts - slope * inner).mean()) if size > 1 else start + 0.5
        slope32 = float(torch.tensor(slope * unit, dtype=torch.float32))
        offset32 = float(torch.tensor((offset + ROUNDING_MARGIN) * unit, dtype=torch.float32))
        position = (inner * slope32 + offset32) / unit - ROUNDING_MARGIN  # fp32 rounding: under 2^-16
        if size > 1 and float((position - counts).abs().max()) >= ROUNDING_MARGIN / 2:
            raise AssertionError(f"decade {decade}'s midpoints are off the grid by a bin's {ROUNDING_MARGIN / 2}")
        if (thresholds[decade] * slope32 + offset32) / unit < start + 2 * ROUNDING_MARGIN:
            raise AssertionError(f"decade {decade}'s lower threshold counts below the decade")
        slopes.append(slope32)
        offsets.append(offset32)
        caps.append(start + size - 1)
    slopes = slopes + [0.0]
    offsets = offsets + [(positive.numel() + 0.5 + ROUNDING_MARGIN) * unit]
    caps = caps + [positive.numel()]
    words = torch.zeros(ROUNDING_WORDS, dtype=torch.int32)
    floats = words.view(torch.float32)
    for group in range(ROUNDING_GROUPS):
        low, high = 2.0 ** (2 * group - 31), 2.0 ** (2 * group - 29)
        inside = [threshold for threshold in thresholds if low <= threshold < high]
        if len(inside) > 1:
            raise AssertionError(f"two decade thresholds in [{low}, {high})")
        floats[group] = inside[0] if inside else float("inf")
        words[16 + group] = sum(threshold < low for threshold in thresholds)
    floats[32 : 32 + len(slopes)] = torch.tensor(slopes)
    floats[48 : 48 + len(offsets)] = torch.tensor(offsets)
    words[64 : 64 + len(caps)] = torch.tensor(caps, dtype=torch.int32)
    floats[80:336] = float("inf")
    floats[80 : 80 + positive.numel()] = positive
    words[336] = int(signed)
    return words


def block_absmax(rows: torch.Tensor) -> torch.Tensor:
    """Per block (row of a (blocks, BLOCK) tensor): the largest absolute value."""
    return rows.abs().amax(dim=1)


def quantize(rows: torch.Tensor, absmax: torch.Tensor, book: Codebook) -> torch.Tensor:
    """Codes (uint8, same shape) of a (blocks, BLOCK) tensor given each block's scale:
    the nearest code value to x * (1 / absmax), a tie going to the smaller one."""
    scaled = (rows * absmax.clamp(min=TINY_SCALE).reciprocal().unsqueeze(1)).reshape(-1)
    cells = scaled.view(torch.int32).bitwise_right_shift(CELL_SHIFT).bitwise_and_((1 << (32 - CELL_SHIFT)) - 1)
    codes = book.below.index_select(0, cells)
    above = scaled > book.boundary.index_select(0, cells)
    return codes.add_(above.to(torch.uint8)).view(rows.shape)


def dequantize(codes: torch.Tensor, absmax: torch.Tensor, book: Codebook) -> torch.Tensor:
    """fp32 values of (blocks, BLOCK) codes: code value times the block's scale."""
    values = book.values.index_select(0, codes.reshape(-1).int()).view(codes.shape)
    return values.mul_(absmax.unsqueeze(1))


def dequantize_piece(codes: torch.Tensor, absmax: torch.Tensor, start: int, book: Codebook) -> torch.Tensor:
    """fp32 values of a piece's codes (elements [start, start + len) of the parameter),
    `absmax` holding one scale per block the piece touches."""
    blocks = PaddedRows(start, codes.numel(), BLOCK)
    return blocks.unpad(dequantize(blocks.pad(codes), absmax, book))
