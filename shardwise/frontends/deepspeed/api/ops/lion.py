"""`deepspeed.ops.lion`: DeepSpeed's Lion classes on shardwise's Lion (shardwise/runtime/optim/lion.py).

`DeepSpeedCPULion` (DeepSpeed's vectorised CPU op, which Accelerate picks for a 32-bit
bitsandbytes Lion under optimizer offload) and `FusedLion` (its CUDA kernel) compute the
same update except where the momentum interpolation is exactly zero, and each keeps its
kernel's rule there. The optimizer steps the rank's fp32 master partition, so its state
is fp32 whatever `fp32_optimizer_states` says.
"""

from __future__ import annotations

from typing import Any, Iterable

from shardwise.runtime.optim.lion import Lion

__all__ = ["DeepSpeedCPULion", "FusedLion"]


class DeepSpeedCPULion(Lion):
    def __init__(self, model_params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 weight_decay: float = 0.0, fp32_optimizer_states: bool = True):
        super().__init__(model_params, lr=lr, betas=tuple(betas), weight_decay=weight_decay)


class FusedLion(Lion):
    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 weight_decay: float = 0.0, set_grad_none: bool = True):
        super().__init__(params, lr=lr, betas=tuple(betas), weight_decay=weight_decay, step_up_at_zero=True)
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """DeepSpeed's: gradients become None unless the optimizer was built with
        `set_grad_none=False` (then zeroed)."""
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)
