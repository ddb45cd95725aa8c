"""Mixed precision as a policy (as FSDP2's `MixedPrecisionPolicy`): the dtype the model
computes and ZeRO keeps its 16-bit copies in, the dtype gradients travel in, and, for
fp16, how the loss is scaled. fp32 master weights are kept whenever `param_dtype` is not
fp32, unless `master_dtype` says bf16 (DeepSpeed's bf16_master_weights_and_grads with
bf16_optimizer_states): then the optimizer updates the bf16 partition itself and its
states take that dtype (docs/formulas.md#model-states-per-rank). `autocast`: the forward
runs under `torch.autocast` from fp32 parameters (DeepSpeed's torch_autocast), or from bf16
parameters in bf16 (its torch_autocast beside bf16). `grad_accum_dtype` fp32 beside 16-bit
parameters (DeepSpeed's `data_types.grad_accum_dtype`): each micro-batch's gradient is still
computed in the parameters' dtype, but the sum over micro-batches is kept in fp32 (ZeRO's
gradient buffers are fp32; runtime/zero/gradients.py says where each stage converts)."""

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
    master_dtype: torch.dtype = torch.float32  # ZeRO's masters (and so the optimizer's states)
    autocast: bool = False  # the forward under torch.autocast(autocast_dtype)
    autocast_dtype: torch.dtype | None = None  # None: torch's default for the device (bf16 on CPU, fp16 on CUDA)
    grad_accum_dtype: torch.dtype | None = None  # micro-batch gradients summed in; None: param_dtype
    # Step the optimizer once on zero gradients when it is built, before any schedule, as
    # DeepSpeed's FP16_Optimizer and FP16_UnfusedOptimizer do (16-bit training without ZeRO):
    # the first real step is then the optimizer's second (Adam's bias correction) and weight
    # decay has been applied once.
    initial_zero_gradient_step: bool = False

    def __post_init__(self) -> None:
        if self.master_dtype not in (torch.float32, self.param_dtype):
            raise ValueError(f"master_dtype {self.master_dtype} must be fp32 or the parameters' own dtype "
                             f"{self.param_dtype}: masters are fp32 copies, or the partition itself")
        if self.autocast and self.param_dtype != torch.float32 and not self.autocasts_its_own_dtype:
            raise ValueError(f"autocast computes in low precision from fp32 parameters, or in bf16 over bf16 "
                             f"parameters; param_dtype is {self.param_dtype} and autocast_dtype {self.autocast_dtype}: "
                             "use one or the other")
        if self.grad_accum_dtype not in (None, torch.float32, self.param_dtype):
            raise ValueError(f"grad_accum_dtype {self.grad_accum_dtype} must be fp32 or the parameters' own dtype "
                             f"{self.param_dtype}: a sum kept in another 16-bit dtype would lose bits both ways")
        if self.accumulation_dtype != self.param_dtype and self.master_dtype != torch.float32:
            raise ValueError(f"grad_accum_dtype {self.grad_accum_dtype} with master_dtype {self.master_dtype}: 16-bit "
                             "masters take 16-bit gradients (bf16_master_weights_and_grads); use one or the other")

    @property
    def autocasts_its_own_dtype(self) -> bool:
        """bf16 parameters under bf16 autocast (DeepSpeed's `torch_autocast` beside `bf16`):
        the model trains in bf16 as without autocast, except that the ops autocast runs in
        fp32 (losses, softmax) take fp32 inputs."""
        return self.param_dtype == torch.bfloat16 and self.autocast_dtype == torch.bfloat16

    @property
    def accumulation_dtype(self) -> torch.dtype:
        """The dtype ZeRO's gradient buffers sum micro-batches in."""
        return self.grad_accum_dtype or self.param_dtype

    @property
    def communication_dtype(self) -> torch.dtype:
        return self.reduce_dtype or self.param_dtype

    @property
    def keeps_fp32_masters(self) -> bool:
        """16-bit training updates fp32 copies of the weights; fp32 training, and 16-bit
        training with 16-bit masters, update the weights' own partition."""
        return self.param_dtype != self.master_dtype
