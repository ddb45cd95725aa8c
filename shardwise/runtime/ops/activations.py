"""Fused bias + GeLU and SwiGLU, with backward passes that save only their inputs.

bias + GeLU: unfused, a linear layer writes x·Wᵀ + b, then GeLU reads it and writes its
output: two passes over the activation, and the backward of each is another. Here the
linear runs without its bias and one kernel adds the bias and applies GeLU; the backward
recomputes the pre-activation from the saved input in the same kernel that applies
GeLU's derivative, and reduces the bias gradient.

SwiGLU, silu(a) · b: unfused autograd keeps a, silu(a) and b (three activations); this
one keeps a and b and recomputes the sigmoid in backward.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.runtime.ops.kernel import fused

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _gelu_and_derivative(h: torch.Tensor, approximate: str) -> tuple[torch.Tensor, torch.Tensor]:
    if approximate == "tanh":
        inner = _SQRT_2_OVER_PI * (h + 0.044715 * h.pow(3))
        t = torch.tanh(inner)
        derivative = 0.5 * (1 + t) + 0.5 * h * (1 - t * t) * _SQRT_2_OVER_PI * (1 + 3 * 0.044715 * h * h)
        return 0.5 * h * (1 + t), derivative
    cdf = 0.5 * (1 + torch.erf(h / math.sqrt(2.0)))
    return h * cdf, cdf + h * torch.exp(-0.5 * h * h) / math.sqrt(2 * math.pi)


@fused
def _bias_gelu_forward(x: torch.Tensor, bias: torch.Tensor, approximate: str) -> torch.Tensor:
    return F.gelu(x + bias, approximate=approximate)


@fused
def _bias_gelu_backward(grad: torch.Tensor, x: torch.Tensor, bias: torch.Tensor,
                        approximate: str) -> tuple[torch.Tensor, torch.Tensor]:
    h = (x + bias).float()
    dh = grad.float() * _gelu_and_derivative(h, approximate)[1]
    return dh.to(x.dtype), dh.reshape(-1, x.shape[-1]).sum(0).to(bias.dtype)


class _BiasGeLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, bias: torch.Tensor, approximate: str) -> torch.Tensor:
        ctx.save_for_backward(x, bias)
        ctx.approximate = approximate
        return _bias_gelu_forward(x, bias, approximate)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, bias = ctx.saved_tensors
        dx, dbias = _bias_gelu_backward(grad.contiguous(), x, bias, ctx.approximate)
        return dx, dbias, None


def bias_gelu(x: torch.Tensor, bias: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """`gelu(x + bias)`; `approximate` as in `F.gelu` ("none" or "tanh")."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate {approximate!r} is not a GeLU variant: use 'none' or 'tanh'")
    return _BiasGeLU.apply(x, bias, approximate)


@fused
def _swiglu_backward(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    g, a, b = grad.float(), gate.float(), up.float()
    sig = torch.sigmoid(a)
    silu = a * sig
    dgate = g * b * sig * (1 + a * (1 - sig))
    return dgate.to(gate.dtype), (g * silu).to(up.dtype)


@fused
def _swiglu_forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return _swiglu_forward(gate, up)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        return _swiglu_backward(grad.contiguous(), gate, up)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up`, the gated unit of Llama's MLP."""
    return _SwiGLU.apply(gate, up)


class LinearGeLU(nn.Linear):
    """`gelu(linear(x))` with the bias added inside the GeLU kernel; an `nn.Linear` with the
    same parameters, so it replaces one in place (checkpoints and ZeRO-3 see no change)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, approximate: str = "none",
                 device: torch.device | None = None, dtype: torch.dtype | None = None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.approximate = approximate

    @classmethod
    def from_linear(cls, linear: nn.Linear, approximate: str) -> "LinearGeLU":
        """A LinearGeLU holding `linear`'s own Parameter objects (ties and sharing kept)."""
        fused_linear = cls.__new__(cls)
        nn.Module.__init__(fused_linear)
        fused_linear.in_features, fused_linear.out_features = linear.in_features, linear.out_features
        fused_linear.weight, fused_linear.bias = linear.weight, linear.bias
        fused_linear.approximate = approximate
        return fused_linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return F.gelu(F.linear(x, self.weight), approximate=self.approximate)
        return bias_gelu(F.linear(x, self.weight), self.bias, self.approximate)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, approximate={self.approximate!r}"
