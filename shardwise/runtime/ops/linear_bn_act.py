"""The seed's fusion example: linear + batch norm + activation as one operator.

Unfused, the three layers each read and write the whole activation (the linear's output,
the normalised output, the activation's output) and autograd keeps all three. Fused:

- in evaluation, batch norm's running statistics are folded into the linear layer
  (W' = W·γ/σ, b' = (b − μ)·γ/σ + β), so the operator is one matrix multiply whose
  output is written once, with the activation applied in the same kernel;
- in training, one kernel normalises the linear output with the batch statistics and
  applies the activation, and the backward recomputes the normalised values from the
  linear output instead of keeping them: two saved activations (x and the linear output)
  instead of three.

Running statistics are updated as `nn.BatchNorm1d` updates them (unbiased variance,
`momentum`), so the fused module trains and evaluates exactly like the unfused stack.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.runtime.ops.kernel import fused

ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu, "identity": lambda x: x}


def _activation_derivative(pre: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "relu":
        return (pre > 0).to(pre.dtype)
    if activation == "silu":
        sig = torch.sigmoid(pre)
        return sig * (1 + pre * (1 - sig))
    if activation == "gelu":
        cdf = 0.5 * (1 + torch.erf(pre * 0.7071067811865476))
        return cdf + pre * torch.exp(-0.5 * pre * pre) * 0.3989422804014327
    return torch.ones_like(pre)


@fused
def _normalise_forward(z: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, eps: float,
                       activation: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    mean = z.mean(0)
    var = (z - mean).pow(2).mean(0)
    rstd = torch.rsqrt(var + eps)
    return ACTIVATIONS[activation]((z - mean) * rstd * gamma + beta), mean, var


@fused
def _normalise_backward(grad: torch.Tensor, z: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor,
                        mean: torch.Tensor, var: torch.Tensor, *, eps: float,
                        activation: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rstd = torch.rsqrt(var + eps)
    normed = (z - mean) * rstd
    grad_pre = grad * _activation_derivative(normed * gamma + beta, activation)
    dgamma, dbeta = (grad_pre * normed).sum(0), grad_pre.sum(0)
    grad_normed = grad_pre * gamma
    dz = rstd * (grad_normed - grad_normed.mean(0) - normed * (grad_normed * normed).mean(0))
    return dz, dgamma, dbeta


class _BatchNormAct(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, eps: float,
                activation: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        y, mean, var = _normalise_forward(z, gamma, beta, eps, activation)
        ctx.save_for_backward(z, gamma, beta, mean, var)
        ctx.eps, ctx.activation = eps, activation
        ctx.mark_non_differentiable(mean, var)
        return y, mean, var

    @staticmethod
    def backward(ctx, grad: torch.Tensor, _mean_grad: torch.Tensor, _var_grad: torch.Tensor):
        z, gamma, beta, mean, var = ctx.saved_tensors
        dz, dgamma, dbeta = _normalise_backward(grad.contiguous(), z, gamma, beta, mean, var, eps=ctx.eps,
                                                activation=ctx.activation)
        return dz, dgamma, dbeta, None, None


@fused
def _folded(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, activation: str) -> torch.Tensor:
    return ACTIVATIONS[activation](torch.addmm(bias, x, weight.t()))


class FusedLinearBatchNormAct(nn.Module):
    """`act(BatchNorm1d(Linear(x)))` for (batch, features) inputs, as one operator."""

    def __init__(self, in_features: int, out_features: int, activation: str = "relu", eps: float = 1e-5,
                 momentum: float = 0.1):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r} is not one of {sorted(ACTIVATIONS)}")
        self.linear = nn.Linear(in_features, out_features)
        self.bn = nn.BatchNorm1d(out_features, eps=eps, momentum=momentum)
        self.activation = activation

    @classmethod
    def from_modules(cls, linear: nn.Linear, bn: nn.BatchNorm1d, activation: str) -> "FusedLinearBatchNormAct":
        """The fused operator over existing layers' parameters and running statistics."""
        if bn.momentum is None or not bn.track_running_stats or not bn.affine:
            raise ValueError("FusedLinearBatchNormAct needs a BatchNorm1d with affine=True, "
                             "track_running_stats=True and a momentum (not the cumulative average)")
        fused_module = cls(linear.in_features, linear.out_features, activation, bn.eps, bn.momentum)
        fused_module.linear, fused_module.bn = linear, bn
        return fused_module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            raise ValueError(f"FusedLinearBatchNormAct takes (batch, features) inputs, got {tuple(x.shape)}")
        bn = self.bn
        if not self.training:
            scale = bn.weight * torch.rsqrt(bn.running_var + bn.eps)
            weight = self.linear.weight * scale.unsqueeze(1)
            bias = (self.linear.bias - bn.running_mean) * scale + bn.bias
            return _folded(x, weight, bias, self.activation)
        y, mean, var = _BatchNormAct.apply(self.linear(x), bn.weight, bn.bias, bn.eps, self.activation)
        with torch.no_grad():
            rows = x.shape[0]
            bn.running_mean.lerp_(mean, bn.momentum)
            bn.running_var.lerp_(var * rows / max(rows - 1, 1), bn.momentum)
            bn.num_batches_tracked += 1
        return y
