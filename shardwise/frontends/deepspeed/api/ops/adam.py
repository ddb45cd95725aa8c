"""`deepspeed.ops.adam`: DeepSpeed's Adam classes as torch's Adam.

DeepSpeed's `FusedAdam` (CUDA kernel) and `DeepSpeedCPUAdam` (vectorised C++) compute
torch's Adam update; both decouple weight decay by default (AdamW), which `adam_w_mode`
/ `adamw_mode` switches off. Under shardwise the optimizer steps the rank's fp32 master
partition, so its state is fp32 whatever `fp32_optimizer_states` says, and torch's own
fused kernel does the work on CPU and CUDA alike.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]


def _no_bias_correction(name: str) -> ValueError:
    return ValueError(f"{name}(bias_correction=False) is not supported: torch's Adam always corrects the bias "
                      "of its moment estimates; drop the argument")


class FusedAdam(torch.optim.Adam):
    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True):
        if not bias_correction:
            raise _no_bias_correction("FusedAdam")
        super().__init__(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         fused=True, decoupled_weight_decay=adam_w_mode)


class DeepSpeedCPUAdam(torch.optim.Adam):
    def __init__(self, model_params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 amsgrad: bool = False, adamw_mode: bool = True, fp32_optimizer_states: bool = True):
        if not bias_correction:
            raise _no_bias_correction("DeepSpeedCPUAdam")
        super().__init__(model_params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                         amsgrad=amsgrad, fused=True, decoupled_weight_decay=adamw_mode)
