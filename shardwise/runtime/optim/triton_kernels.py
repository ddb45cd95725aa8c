"""One-pass GPU kernels for LAMB and 8-bit Adam, in Triton (C17, issue 27 item 1).

On a GPU the torch path of these optimizers makes one pass over memory per operation
(LAMB's about ten, 8-bit Adam's dequantise, update, block maxima and encode over thirty),
where torch's fused AdamW makes one. These kernels make the passes the arithmetic needs:

- LAMB, two per tensor, as its CPU kernels (optim/native_kernels.c): the moments and both
  squared norms (weight and update, summed per program block, the blocks' sums added in
  float64), then the weight update with the update computed again rather than stored;
  the trust ratio between them needs the norms of whole parameters (optim/sharded.py).
- 8-bit Adam, one per tensor: per 256-element quantisation block, the codes decoded, Adam's
  step taken with bitsandbytes' arithmetic (optim/adam8bit.py), the block's new absmax
  found and the moments encoded again, by arithmetic that gives the torch path's codes
  (`_encode`, the CPU kernels' encoder), writing the codes in place. The first and last
  padded rows are written in fp32 too, for blocks a ZeRO piece boundary cuts
  (optim/shared_blocks.py).

Divisions and square roots are the correctly rounded ones (`div_rn`, `sqrt_rn`, not the
GPU's approximate defaults), so a value's code is the torch path's but where fp32
contraction of a multiply and an add moves it across a code midpoint.

This module imports Triton; optim/triton_gate.py decides whether it is used. Under
Triton's interpreter (`TRITON_INTERPRET=1` before Triton is imported) the same kernels
run on CPU tensors, which is how the test suite checks them on machines without a GPU.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl

from shardwise.runtime.optim.quantization import (BLOCK as QUANTISATION_BLOCK, ROUNDING_FRACTION, TINY_SCALE,
                                                  codebook, decade_rounding)
LAMB_BLOCK = 1024  # elements per program: one partial sum of each squared norm per block
FRACTION: tl.constexpr = tl.constexpr(ROUNDING_FRACTION)
NEAR_BITS: tl.constexpr = tl.constexpr((1 << ROUNDING_FRACTION) - 2)  # a fraction of 0 or 1: near a count
ROUNDING_MIDPOINTS: tl.constexpr = tl.constexpr(80)  # the positive midpoints' first word (`decade_rounding`)


@triton.jit
def _lamb_update(w, m, v, eps, weight_decay, EPS_INSIDE_SQRT: tl.constexpr, DECAY: tl.constexpr):
    """Adam's direction m / (√v + eps) (eps inside the root where asked), plus the decay."""
    if EPS_INSIDE_SQRT:
        update = tl.div_rn(m, tl.sqrt_rn(v + eps))
    else:
        update = tl.div_rn(m, tl.sqrt_rn(v) + eps)
    if DECAY:
        update = update + weight_decay * w
    return update


@triton.jit
def _lamb_moments_and_squares_kernel(param, grad, exp_avg, exp_avg_sq, squares, numel, beta1_complement, beta2,
                                     beta2_complement, eps, weight_decay, EPS_INSIDE_SQRT: tl.constexpr,
                                     DECAY: tl.constexpr, BLOCK: tl.constexpr):
    block = tl.program_id(0)
    offsets = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < numel
    w = tl.load(param + offsets, mask=inside, other=0.0)
    g = tl.load(grad + offsets, mask=inside, other=0.0)
    m = tl.load(exp_avg + offsets, mask=inside, other=0.0)
    v = tl.load(exp_avg_sq + offsets, mask=inside, other=0.0)
    m = m + beta1_complement * (g - m)  # torch.lerp(m, g, 1 - beta1)
    v = v * beta2 + beta2_complement * g * g
    tl.store(exp_avg + offsets, m, mask=inside)
    tl.store(exp_avg_sq + offsets, v, mask=inside)
    update = tl.where(inside, _lamb_update(w, m, v, eps, weight_decay, EPS_INSIDE_SQRT, DECAY), 0.0)
    tl.store(squares + 2 * block, tl.sum(w * w, axis=0))
    tl.store(squares + 2 * block + 1, tl.sum(update * update, axis=0))


@triton.jit
def _lamb_apply_kernel(param, exp_avg, exp_avg_sq, numel, scale, eps, weight_decay, EPS_INSIDE_SQRT: tl.constexpr,
                       DECAY: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < numel
    w = tl.load(param + offsets, mask=inside, other=0.0)
    m = tl.load(exp_avg + offsets, mask=inside, other=0.0)
    v = tl.load(exp_avg_sq + offsets, mask=inside, other=0.0)
    update = _lamb_update(w, m, v, eps, weight_decay, EPS_INSIDE_SQRT, DECAY)
    tl.store(param + offsets, w + update * scale, mask=inside)


@triton.jit
def _midpoints_below(a, rounding):
    """F(a), the code's positive midpoints below a >= 0 (a NaN counts all of them), by
    arithmetic over optim/quantization.py's `decade_rounding` words: native_kernels.c's
    `count_midpoints_below`, step for step. The table lookup read two entries of a 640 KB
    table per element and moment, which held the H100 at 8x its byte limit; these words
    are 1.4 KB."""
    top = tl.full([], 1.5, tl.float32)  # fp32 constants: the interpreter widens a bare float to fp64
    a = tl.where(a != a, top, a)
    a = tl.maximum(tl.minimum(a, top), tl.full([], 2.0**-30, tl.float32))
    pair = (a.to(tl.int32, bitcast=True) >> 24) & 15  # the exponent's pair of binades, mod 16 as AVX-512 permutes
    base = tl.load(rounding + 16 + pair)
    threshold = tl.load(rounding + pair).to(tl.float32, bitcast=True)
    region = base + (a > threshold).to(tl.int32)
    slope = tl.load(rounding + 32 + region).to(tl.float32, bitcast=True)
    offset = tl.load(rounding + 48 + region).to(tl.float32, bitcast=True)
    fixed = tl.fma(a, slope, offset).to(tl.int32)
    count = tl.minimum(fixed >> FRACTION, tl.load(rounding + 64 + region))
    near = (fixed & NEAR_BITS) == 0  # within a unit of the count: the midpoint decides
    midpoint = tl.load(rounding + ROUNDING_MIDPOINTS + count - 1, mask=near & (count > 0), other=0)
    return count - (near & (a <= midpoint.to(tl.float32, bitcast=True))).to(tl.int32)


@triton.jit
def _encode(x, absmax, rounding, SIGNED: tl.constexpr, TINY: tl.constexpr):
    """The nearest code of x / absmax (a tie to the smaller): the codes of
    optim/quantization.py's `quantize` for every fp32 value, as native_kernels.c's `codes_of`."""
    # the bound as an fp32 value (Triton 3.6's interpreter widens a bare float to fp64); a NaN
    # scale stays NaN, as torch's clamp keeps it
    bound = tl.maximum(absmax, tl.full([], TINY, tl.float32), propagate_nan=tl.PropagateNan.ALL)
    scaled = x * tl.div_rn(1.0, bound)
    if not SIGNED:
        return _midpoints_below(scaled, rounding)
    negative = scaled < 0.0
    # x < 0: the midpoints m with -m < x, 127 - #(m <= |x|) = 127 - F(|x| one ulp up)
    magnitude = (scaled.to(tl.int32, bitcast=True) & 0x7FFFFFFF) + negative.to(tl.int32)
    count = _midpoints_below(magnitude.to(tl.float32, bitcast=True), rounding)
    return tl.where(negative, tl.maximum(127 - count, 0), tl.minimum(127 + count, 255))


@triton.jit
def _nan_propagating_absmax(x):
    """The block's largest |x|, NaN if any element is, as torch's amax (a GPU's max
    reduction would skip NaNs, leaving a NaN moment coded against a finite scale)."""
    largest = tl.max(tl.abs(x), axis=0)
    return tl.where(tl.sum((x != x).to(tl.int32), axis=0) > 0, float("nan"), largest)


@triton.jit
def _adam8bit_kernel(param, grad, m_codes, m_absmax, v_codes, v_absmax, m_fp32, v_fp32, edges, m_values, m_rounding,
                     v_values, v_rounding, numel, offset, rows, beta1, beta1_complement, beta2, beta2_complement, eps,
                     decay_factor, correction2, step_scale, FROM_FP32: tl.constexpr, DECAY: tl.constexpr,
                     TINY: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    lane = tl.arange(0, BLOCK)
    element = row.to(tl.int64) * BLOCK + lane - offset  # in the piece; the row is the parameter's block
    inside = (element >= 0) & (element < numel)
    g = tl.load(grad + element, mask=inside, other=0.0)
    w = tl.load(param + element, mask=inside, other=0.0)
    if FROM_FP32:
        m = tl.load(m_fp32 + element, mask=inside, other=0.0)
        v = tl.load(v_fp32 + element, mask=inside, other=0.0)
    else:
        m_code = tl.load(m_codes + element, mask=inside, other=0).to(tl.int32)
        v_code = tl.load(v_codes + element, mask=inside, other=0).to(tl.int32)
        m = tl.where(inside, tl.load(m_values + m_code) * tl.load(m_absmax + row), 0.0)
        v = tl.where(inside, tl.load(v_values + v_code) * tl.load(v_absmax + row), 0.0)
    m = m * beta1 + beta1_complement * g
    v = v * beta2 + beta2_complement * g * g
    if DECAY:
        w = w * decay_factor
    w = w + step_scale * tl.div_rn(m, tl.div_rn(tl.sqrt_rn(v), correction2) + eps)
    tl.store(param + element, w, mask=inside)
    m_max = _nan_propagating_absmax(m)
    v_max = _nan_propagating_absmax(v)
    tl.store(m_absmax + row, m_max)
    tl.store(v_absmax + row, v_max)
    tl.store(m_codes + element, _encode(m, m_max, m_rounding, True, TINY).to(tl.uint8), mask=inside)
    tl.store(v_codes + element, _encode(v, v_max, v_rounding, False, TINY).to(tl.uint8), mask=inside)
    padded = row * BLOCK + lane  # in the piece's padded rows
    first_row, last_row = padded < BLOCK, padded >= (rows - 1) * BLOCK
    tl.store(edges + lane, m, mask=first_row)
    tl.store(edges + BLOCK + lane, m, mask=last_row)
    tl.store(edges + 2 * BLOCK + lane, v, mask=first_row)
    tl.store(edges + 3 * BLOCK + lane, v, mask=last_row)


def lamb_moments_and_squares(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                             exp_avg_sqs: list[torch.Tensor], *, beta1: float, beta2: float, eps: float,
                             weight_decay: float, eps_inside_sqrt: bool) -> torch.Tensor:
    """LAMB's pass 1 over a group's tensors: moments advanced in place; returns their
    (tensors, 2) float64 squared norms of weight and update."""
    blocks = [triton.cdiv(p.numel(), LAMB_BLOCK) for p in params]
    partial = torch.empty(sum(blocks), 2, dtype=torch.float32, device=params[0].device)
    start = 0
    with _on(partial.device):
        for param, grad, exp_avg, exp_avg_sq, count in zip(params, grads, exp_avgs, exp_avg_sqs, blocks):
            if count:
                _lamb_moments_and_squares_kernel[(count,)](
                    param, grad, exp_avg, exp_avg_sq, partial[start:], param.numel(), 1.0 - beta1, beta2,
                    1.0 - beta2, eps, weight_decay, EPS_INSIDE_SQRT=eps_inside_sqrt, DECAY=weight_decay != 0.0,
                    BLOCK=LAMB_BLOCK)
            start += count
    owner = torch.repeat_interleave(torch.arange(len(params), device=partial.device),
                                    torch.tensor(blocks, device=partial.device))
    return torch.zeros(len(params), 2, dtype=torch.float64, device=partial.device).index_add_(0, owner,
                                                                                              partial.double())


def lamb_apply(params: list[torch.Tensor], exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor],
               scales: list[float], *, eps: float, weight_decay: float, eps_inside_sqrt: bool) -> None:
    """LAMB's pass 2: w += scale · update per tensor, the update computed again."""
    with _on(params[0].device if params else torch.device("cpu")):
        for param, exp_avg, exp_avg_sq, scale in zip(params, exp_avgs, exp_avg_sqs, scales):
            count = triton.cdiv(param.numel(), LAMB_BLOCK)
            if count:
                _lamb_apply_kernel[(count,)](param, exp_avg, exp_avg_sq, param.numel(), scale, eps, weight_decay,
                                             EPS_INSIDE_SQRT=eps_inside_sqrt, DECAY=weight_decay != 0.0,
                                             BLOCK=LAMB_BLOCK)


def adam8bit_step(param: torch.Tensor, grad: torch.Tensor, *, moments: tuple[torch.Tensor, torch.Tensor] | None,
                  coded: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None, offset: int,
                  rows: int, lr: float, beta1: float, beta2: float, eps: float, decay: float, correction1: float,
                  correction2: float) -> tuple[torch.Tensor, ...]:
    """8-bit Adam's step on one piece (elements of the parameter's padded rows from `offset`
    on, `rows` blocks), from fp32 `moments` or from `coded` ones (codes and absmax of each,
    rewritten in place). Returns what optim/adam8bit.py's `_step_and_quantise` does: per
    moment its codes, block scales and first and last padded rows in fp32."""
    numel = param.numel()
    device = param.device
    if coded is None:
        coded = (torch.empty(numel, dtype=torch.uint8, device=device), torch.empty(rows, device=device),
                 torch.empty(numel, dtype=torch.uint8, device=device), torch.empty(rows, device=device))
    m_codes, m_absmax, v_codes, v_absmax = coded
    edges = torch.zeros(2, 2, QUANTISATION_BLOCK, device=device)
    m_fp32, v_fp32 = moments if moments is not None else (param, param)  # not read without FROM_FP32
    if rows:
        with _on(device):
            _adam8bit_kernel[(rows,)](
                param, grad, m_codes, m_absmax, v_codes, v_absmax, m_fp32, v_fp32, edges, *_device_book(True, device),
                *_device_book(False, device), numel, offset, rows, beta1, 1.0 - beta1, beta2, 1.0 - beta2, eps,
                1.0 - lr * decay, correction2, -lr / correction1, FROM_FP32=moments is not None, DECAY=decay > 0.0,
                TINY=TINY_SCALE, BLOCK=QUANTISATION_BLOCK)
    return m_codes, m_absmax, edges[0], v_codes, v_absmax, edges[1]


@functools.cache
def _device_book(signed: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A code's values and its encoder's words on `device`, copied there once per process."""
    return codebook(signed).values.to(device), decade_rounding(signed).to(device)


def _on(device: torch.device) -> contextlib.AbstractContextManager:
    """Triton launches on the current CUDA device: the tensors' own, for the call."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
