"""`deepspeed.ops.adagrad.DeepSpeedCPUAdagrad`: DeepSpeed's vectorised CPU Adagrad (which
Accelerate picks for a torch Adagrad under optimizer offload) as `torch.optim.Adagrad`.

DeepSpeed's op computes torch's Adagrad update with no learning-rate decay and a zero
initial accumulator (weight decay added to the gradient); `amsgrad` is accepted and
ignored, as DeepSpeed's op ignores it. The optimizer steps the rank's fp32 master
partition, so its state is fp32 whatever `fp32_optimizer_states` says.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

__all__ = ["DeepSpeedCPUAdagrad"]


class DeepSpeedCPUAdagrad(torch.optim.Adagrad):
    def __init__(self, model_params: Iterable[Any], lr: float = 1e-2, eps: float = 1e-10, weight_decay: float = 0.0,
                 amsgrad: bool = False, fp32_optimizer_states: bool = True):
        super().__init__(model_params, lr=lr, eps=eps, weight_decay=weight_decay)
