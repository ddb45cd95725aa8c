"""`deepspeed.ops.lamb.FusedLamb`: shardwise's LAMB (shardwise/runtime/optim/lamb.py), which
follows DeepSpeed's kernel (bias corrections in the step size, eps outside the square
root unless `eps_inside_sqrt`, trust ratio clamped to [min_coeff, max_coeff])."""

from __future__ import annotations

from typing import Any, Iterable

from shardwise.runtime.optim.lamb import Lamb

__all__ = ["FusedLamb"]


class FusedLamb(Lamb):
    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, eps_inside_sqrt: bool = False,
                 weight_decay: float = 0.0, max_grad_norm: float = 0.0, max_coeff: float = 10.0,
                 min_coeff: float = 0.01, amsgrad: bool = False):
        if amsgrad:
            raise RuntimeError("FusedLamb does not support the AMSGrad variant (neither does DeepSpeed's)")
        if max_grad_norm:
            raise ValueError(f"FusedLamb(max_grad_norm={max_grad_norm}): clip through the config's "
                             "gradient_clipping instead, which the engine applies to the global norm")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         bias_correction=bias_correction, eps_inside_sqrt=eps_inside_sqrt,
                         max_coeff=max_coeff, min_coeff=min_coeff)
