"""Fused RMSNorm and LayerNorm: one kernel forward, one backward, saving only x and the statistics.

Unfused, RMSNorm is five torch calls (square, mean, add, rsqrt, two multiplies), each
reading and writing the whole activation, and autograd keeps several of their outputs
for backward. Here the forward body computes the normalised output and the per-row
inverse standard deviation in one pass; backward recomputes x̂ from x and the statistic
and applies the closed-form gradient:

    dx = rstd · (g·w − x̂ · mean(g·w · x̂))          (RMSNorm)
    dx = rstd · (g·w − mean(g·w) − x̂ · mean(g·w · x̂))  (LayerNorm)

Statistics are computed in fp32 whatever the input dtype, as Llama's RMSNorm does.
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.runtime.ops.kernel import fused


@fused
def _rms_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    x32 = x.float()
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (x32 * rstd).to(x.dtype), rstd


@fused
def _rms_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                  rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    normed = x.float() * rstd
    grad_normed = grad.float() * weight.float()
    dx = rstd * (grad_normed - normed * (grad_normed * normed).mean(-1, keepdim=True))
    dweight = (grad.float() * normed.to(x.dtype).float()).reshape(-1, x.shape[-1]).sum(0)
    return dx.to(x.dtype), dweight.to(weight.dtype)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        y, rstd = _rms_forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        dx, dweight = _rms_backward(grad.contiguous(), x, weight, rstd)
        return dx, dweight, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """`weight * (x / sqrt(mean(x²) + eps))` over the last dimension, statistics in fp32."""
    return _RMSNorm.apply(x, weight, eps)


@fused
def _layer_forward(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x32 = x.float()
    mean = x32.mean(-1, keepdim=True)
    rstd = torch.rsqrt((x32 - mean).pow(2).mean(-1, keepdim=True) + eps)
    y = (x32 - mean) * rstd
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype), mean, rstd


@fused
def _layer_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, mean: torch.Tensor,
                    rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    normed = (x.float() - mean) * rstd
    g = grad.float()
    grad_normed = g * weight.float() if weight is not None else g
    dx = rstd * (grad_normed - grad_normed.mean(-1, keepdim=True)
                 - normed * (grad_normed * normed).mean(-1, keepdim=True))
    width = x.shape[-1]
    return dx.to(x.dtype), (g * normed).reshape(-1, width).sum(0), g.reshape(-1, width).sum(0)


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                eps: float) -> torch.Tensor:
        y, mean, rstd = _layer_forward(x, weight, bias, eps)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, mean, rstd = ctx.saved_tensors
        dx, dweight, dbias = _layer_backward(grad.contiguous(), x, weight, mean, rstd)
        return (dx, dweight.to(weight.dtype) if weight is not None else None,
                dbias.to(x.dtype) if ctx.has_bias else None, None)


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
               eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm over the last dimension, statistics in fp32."""
    return _LayerNorm.apply(x, weight, bias, eps)


class FusedRMSNorm(nn.Module):
    """RMSNorm with Llama's parameter and attribute names (`weight`, `variance_epsilon`)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.variance_epsilon}"


class FusedLayerNorm(nn.LayerNorm):
    """`nn.LayerNorm` (same parameters and state dict) over the last dimension, fused."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.normalized_shape) != 1:
            raise ValueError(f"FusedLayerNorm normalises the last dimension only, not {self.normalized_shape}")
        return layer_norm(x, self.weight, self.bias, self.eps)
