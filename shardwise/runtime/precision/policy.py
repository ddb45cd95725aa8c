"""Mixed precision as a policy (as FSDP2's `MixedPrecisionPolicy`): the dtype the model
computes and ZeRO keeps its 16-bit copies in, the dtype gradients travel in, and, for
fp16, how the loss is scaled. fp32 master weights are kept whenever `param_dtype` is not
fp32 (docs/formulas.md#model-states-per-rank)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LossScalingPolicy:
    """fp16's loss scale: `dynamic` is DeepSpeed's rule (start at `initial_scale`; an
    overflow skips the step and halves the scale after `hysteresis` tolerated overflows,
    never below `min_scale`; `window` clean steps double it); otherwise the scale is fixed."""

    initial_scale: float = 2.0**16
    dynamic: bool = True
    window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_scale: float = 1.0


@dataclass(frozen=True)
class PrecisionPolicy:
    param_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype | None = None  # None: the gradients' own dtype (param_dtype)
    loss_scaling: LossScalingPolicy | None = None  # fp16 needs one; bf16 and fp32 do not

    @property
    def communication_dtype(self) -> torch.dtype:
        return self.reduce_dtype or self.param_dtype

    @property
    def keeps_fp32_masters(self) -> bool:
        """16-bit training updates fp32 copies of the weights; fp32 updates the weights."""
        return self.param_dtype != torch.float32
