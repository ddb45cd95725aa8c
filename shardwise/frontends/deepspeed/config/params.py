"""The `params` of the `optimizer` and `scheduler` blocks, one model per `type`.

DeepSpeed passes `params` straight to the optimizer or scheduler constructor, so
which keys are valid depends on `type`. Defaults are those of the code DeepSpeed
runs: its Adam path (`FusedAdam` / `torch.optim.Adam(W)` with `adam_w_mode`
defaulting to True, i.e. decoupled weight decay even for type "Adam"),
`torch.optim.SGD`, and the classes in deepspeed/runtime/lr_schedules.py (whose
constructor defaults differ from its argparse defaults; the constructors win).
Optimizers DeepSpeed does not build itself take the defaults of the implementation
shardwise matches: timm (Lars), torch.optim (Adafactor, Muon), bitsandbytes (8-bit Adam).
"""

from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from shardwise.frontends.deepspeed.config.errors import describe_validation_error
from shardwise.frontends.deepspeed.config.fields import Bool, Float, Int, Section


def _check_betas(betas: tuple[float, float]) -> tuple[float, float]:
    if not all(0.0 <= beta < 1.0 for beta in betas):
        raise ValueError(f"betas {list(betas)} must each lie in [0, 1)")
    return betas


def _check_nesterov(nesterov: bool, momentum: float, dampening: float) -> None:
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError(
            f"nesterov needs momentum > 0 and dampening 0, got momentum {momentum} and dampening {dampening}"
        )


class AdamParams(Section):
    """Adam and AdamW; shardwise builds them with `torch.optim`."""

    lr: Float = Field(1e-3, ge=0)
    betas: tuple[Float, Float] = (0.9, 0.999)
    eps: Float = Field(1e-8, gt=0)
    weight_decay: Float = Field(0.0, ge=0)
    amsgrad: Bool = False
    adam_w_mode: Bool = True
    torch_adam: Bool = Field(
        False,
        description="DeepSpeed's switch from its fused kernel to torch.optim; accepted so "
        "DeepSpeed configs load, without effect because shardwise always uses torch.optim",
    )
    bias_correction: Bool = True

    @field_validator("betas")
    @classmethod
    def _betas_in_unit_interval(cls, betas: tuple[float, float]) -> tuple[float, float]:
        return _check_betas(betas)

    @field_validator("bias_correction")
    @classmethod
    def _bias_correction_on(cls, enabled: bool) -> bool:
        if not enabled:
            raise ValueError("bias_correction false is not supported yet: torch.optim's Adam always corrects bias")
        return enabled


class LambParams(Section):
    """LAMB with DeepSpeed's FusedLamb parameters and defaults (shardwise.runtime.optim.Lamb)."""

    lr: Float = Field(1e-3, ge=0)
    betas: tuple[Float, Float] = (0.9, 0.999)
    eps: Float = Field(1e-8, gt=0)
    weight_decay: Float = Field(0.0, ge=0)
    bias_correction: Bool = True
    eps_inside_sqrt: Bool = False
    max_coeff: Float = Field(10.0, ge=0)
    min_coeff: Float = Field(0.01, ge=0)
    amsgrad: Bool = False
    compile: Bool = Field(False, description="torch.compile the step's per-tensor loops (optim/compiled.py)")

    @field_validator("betas")
    @classmethod
    def _betas_in_unit_interval(cls, betas: tuple[float, float]) -> tuple[float, float]:
        return _check_betas(betas)

    @field_validator("amsgrad")
    @classmethod
    def _no_amsgrad(cls, enabled: bool) -> bool:
        if enabled:
            raise ValueError("amsgrad true is not supported by LAMB (DeepSpeed's FusedLamb refuses it too)")
        return enabled

    @model_validator(mode="after")
    def _coefficients_ordered(self) -> "LambParams":
        if self.min_coeff > self.max_coeff:
            raise ValueError(f"min_coeff {self.min_coeff} is above max_coeff {self.max_coeff}")
        return self


class LarsParams(Section):
    """LARS (shardwise.runtime.optim.Lars), with timm's `Lars` defaults."""

    lr: Float = Field(1.0, ge=0)
    momentum: Float = Field(0.0, ge=0)
    dampening: Float = 0.0
    weight_decay: Float = Field(0.0, ge=0)
    nesterov: Bool = False
    trust_coefficient: Float = Field(0.001, ge=0)
    eps: Float = Field(1e-8, ge=0)
    exclude_vectors: Bool = Field(
        True, description="parameters with fewer than 2 dimensions (biases, norms) take trust ratio 1")
    compile: Bool = Field(False, description="torch.compile the step's per-tensor loops (optim/compiled.py)")

    @model_validator(mode="after")
    def _nesterov_needs_momentum(self) -> "LarsParams":
        _check_nesterov(self.nesterov, self.momentum, self.dampening)
        return self


class AdafactorParams(Section):
    """Adafactor (shardwise.runtime.optim.Adafactor) with torch.optim.Adafactor's parameters and defaults."""

    lr: Float = Field(1e-2, ge=0)
    beta2_decay: Float = Field(-0.8, le=0)
    eps: tuple[Float | None, Float] = Field(
        (None, 1e-3), description="(epsilon1: floor of the second-moment estimate, null for the dtype's "
        "machine epsilon; epsilon2: floor of a parameter's RMS in the step size)")
    d: Float = Field(1.0, ge=1)
    weight_decay: Float = Field(0.0, ge=0)
    maximize: Bool = False

    @field_validator("eps")
    @classmethod
    def _eps_not_negative(cls, eps: tuple[float | None, float]) -> tuple[float | None, float]:
        if (eps[0] is not None and eps[0] < 0) or eps[1] < 0:
            raise ValueError(f"eps {list(eps)}: epsilon1 must be null or >= 0, epsilon2 >= 0")
        return eps


class Adam8bitParams(Section):
    """8-bit Adam (shardwise.runtime.optim.Adam8bit) with bitsandbytes' `Adam8bit` defaults; weight
    decay is decoupled, as bitsandbytes applies it."""

    lr: Float = Field(1e-3, ge=0)
    betas: tuple[Float, Float] = (0.9, 0.999)
    eps: Float = Field(1e-8, ge=0)
    weight_decay: Float = Field(0.0, ge=0)
    min_8bit_size: Int = Field(4096, ge=0, description="parameters with fewer elements keep fp32 moments")

    @field_validator("betas")
    @classmethod
    def _betas_in_unit_interval(cls, betas: tuple[float, float]) -> tuple[float, float]:
        return _check_betas(betas)


class AdamW8bitParams(Adam8bitParams):
    """bitsandbytes' `AdamW8bit`: `Adam8bit` with weight decay 1e-2 by default."""

    weight_decay: Float = Field(1e-2, ge=0)


class MuonParams(Section):
    """Muon for 2-D parameters and AdamW for the rest (shardwise.runtime.optim.Muon): torch.optim.Muon's
    and torch.optim.AdamW's defaults, DeepSpeed's `muon_lr` / `adam_lr` keys (default: `lr`)."""

    lr: Float = Field(1e-3, ge=0)
    weight_decay: Float = Field(0.1, ge=0)
    momentum: Float = Field(0.95, ge=0)
    nesterov: Bool = True
    ns_coefficients: tuple[Float, Float, Float] = (3.4445, -4.775, 2.0315)
    ns_eps: Float = Field(1e-7, ge=0)
    ns_steps: Int = Field(5, ge=0, lt=100)
    ns_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    adjust_lr_fn: Literal["original", "match_rms_adamw"] | None = None
    muon_lr: Float | None = Field(None, ge=0, json_schema_extra={"default_doc": "lr"})
    adam_lr: Float | None = Field(None, ge=0, json_schema_extra={"default_doc": "lr"})
    betas: tuple[Float, Float] = (0.9, 0.999)
    eps: Float = Field(1e-8, ge=0)

    @field_validator("betas")
    @classmethod
    def _betas_in_unit_interval(cls, betas: tuple[float, float]) -> tuple[float, float]:
        return _check_betas(betas)


class OneBitAdamParams(Section):
    """1-bit Adam (shardwise.runtime.optim.OneBitAdam) with DeepSpeed's `OneBitAdam` parameters and
    defaults. `bias_correction` is applied (DeepSpeed accepts it and never does: give false
    for its arithmetic); `cuda_aware` and `comm_backend_name` choose DeepSpeed's transport
    and are accepted without effect: the exchange runs on the data-parallel group's backend."""

    lr: Float = Field(1e-3, ge=0)
    freeze_step: Int = Field(100000, ge=1, description="warm-up steps with full-precision gradients, after "
                             "which the variance is frozen and the momentum exchanged at 1 bit per element")
    bias_correction: Bool = True
    betas: tuple[Float, Float] = (0.9, 0.999)
    eps: Float = Field(1e-8, gt=0)
    eps_inside_sqrt: Bool = False
    weight_decay: Float = Field(0.0, ge=0)
    max_grad_norm: Float = Field(0.0, description="accepted as 0 only: clip with gradient_clipping")
    amsgrad: Bool = False
    cuda_aware: Bool = False
    comm_backend_name: Literal["nccl", "gloo", "mpi", "hccl", "compressed"] = "nccl"

    @field_validator("betas")
    @classmethod
    def _betas_in_unit_interval(cls, betas: tuple[float, float]) -> tuple[float, float]:
        return _check_betas(betas)

    @field_validator("amsgrad")
    @classmethod
    def _no_amsgrad(cls, enabled: bool) -> bool:
        if enabled:
            raise ValueError("amsgrad true: 1-bit Adam/LAMB have no AMSGrad variant (DeepSpeed refuses it too)")
        return enabled

    @field_validator("max_grad_norm")
    @classmethod
    def _clip_elsewhere(cls, norm: float) -> float:
        if norm:
            raise ValueError(f"max_grad_norm {norm}: DeepSpeed's 1-bit optimizers ignore it; clip with the "
                             "top-level gradient_clipping instead")
        return norm


class OneBitLambParams(OneBitAdamParams):
    """1-bit LAMB (shardwise.runtime.optim.OneBitLamb) with DeepSpeed's `OneBitLamb` parameters and
    defaults: LAMB's trust-ratio bounds, and the limits on the variance factor that
    replaces the trust ratio after the warm-up."""

    max_coeff: Float = Field(10.0, ge=0)
    min_coeff: Float = Field(0.01, ge=0)
    coeff_beta: Float = Field(0.9, ge=0, lt=1)
    factor_max: Float = Field(4.0, gt=0)
    factor_min: Float = Field(0.5, gt=0)
    factor_threshold: Float = Field(0.1, ge=0)

    @model_validator(mode="after")
    def _bounds_ordered(self) -> "OneBitLambParams":
        if self.min_coeff > self.max_coeff:
            raise ValueError(f"min_coeff {self.min_coeff} is above max_coeff {self.max_coeff}")
        if self.factor_min > self.factor_max:
            raise ValueError(f"factor_min {self.factor_min} is above factor_max {self.factor_max}")
        return self


class SGDParams(Section):
    """`torch.optim.SGD`, which DeepSpeed builds for any type it does not know itself."""

    lr: Float = Field(1e-3, ge=0)
    momentum: Float = Field(0.0, ge=0)
    dampening: Float = 0.0
    weight_decay: Float = Field(0.0, ge=0)
    nesterov: Bool = False

    @model_validator(mode="after")
    def _nesterov_needs_momentum(self) -> "SGDParams":
        _check_nesterov(self.nesterov, self.momentum, self.dampening)
        return self


class WarmupLRParams(Section):
    """Warm up from warmup_min_lr to warmup_max_lr, then hold."""

    warmup_min_lr: Float = Field(0.0, ge=0)
    warmup_max_lr: Float | None = Field(None, ge=0, json_schema_extra={"default_doc": "the optimizer's lr"})
    warmup_num_steps: Int = Field(1000, ge=1)
    warmup_type: Literal["log", "linear"] = "log"
    last_batch_iteration: Int = Field(-1, ge=-1)

    @model_validator(mode="after")
    def _min_below_max(self) -> "WarmupLRParams":
        if self.warmup_max_lr is not None and self.warmup_min_lr > self.warmup_max_lr:
            raise ValueError(
                f"warmup_min_lr {self.warmup_min_lr} is above warmup_max_lr {self.warmup_max_lr}"
            )
        return self


def _warmup_fits(total_num_steps: int, warmup_num_steps: int) -> None:
    if total_num_steps < warmup_num_steps:
        raise ValueError(
            f"total_num_steps {total_num_steps} < warmup_num_steps {warmup_num_steps}: "
            "the schedule would end before its warmup does"
        )


class WarmupDecayLRParams(WarmupLRParams):
    """WarmupLR, then linear decay to zero at total_num_steps."""

    total_num_steps: Int = Field(ge=1)
    warmup_max_lr: Float | None = Field(0.001, ge=0)

    @model_validator(mode="after")
    def _warmup_within_total(self) -> "WarmupDecayLRParams":
        _warmup_fits(self.total_num_steps, self.warmup_num_steps)
        return self


class WarmupCosineLRParams(Section):
    """Warm up from warmup_min_ratio x lr to lr, then cosine decay to cos_min_ratio x lr."""

    total_num_steps: Int = Field(ge=1)
    warmup_min_ratio: Float = Field(0.0, ge=0, le=1)
    warmup_num_steps: Int = Field(1000, ge=1)
    cos_min_ratio: Float = Field(0.0001, ge=0, le=1)
    warmup_type: Literal["log", "linear"] = "log"
    last_batch_iteration: Int = Field(-1, ge=-1)

    @model_validator(mode="after")
    def _warmup_within_total(self) -> "WarmupCosineLRParams":
        _warmup_fits(self.total_num_steps, self.warmup_num_steps)
        return self


OPTIMIZER_PARAMS: dict[str, type[Section]] = {
    "Adam": AdamParams, "AdamW": AdamParams, "SGD": SGDParams, "Lamb": LambParams, "Lars": LarsParams,
    "Adafactor": AdafactorParams, "Adam8bit": Adam8bitParams, "AdamW8bit": AdamW8bitParams, "Muon": MuonParams,
    "OneBitAdam": OneBitAdamParams, "OneBitLamb": OneBitLambParams,
}
SCHEDULER_PARAMS: dict[str, type[Section]] = {
    "WarmupLR": WarmupLRParams,
    "WarmupDecayLR": WarmupDecayLRParams,
    "WarmupCosineLR": WarmupCosineLRParams,
}

# DeepSpeed's types a later capability may add (0/1 Adam: C18's variant with adaptive variance freezing).
OPTIMIZERS_NOT_YET = ("ZeroOneAdam",)
# Types DeepSpeed builds itself that no shardwise capability covers.
DEEPSPEED_OPTIMIZERS_UNSUPPORTED = ("Adagrad", "Lion", "MuAdam", "MuAdamW", "MuSGD")
DEEPSPEED_SCHEDULERS_UNSUPPORTED = ("OneCycle", "LRRangeTest")

# Adam keys that choose the torch class or are fixed by it, rather than being constructor arguments.
ADAM_SELECTOR_PARAMS = ("adam_w_mode", "torch_adam", "bias_correction")


def resolve_params(block: str, type_name: str, params: dict[str, Any], problems: list[str]) -> dict[str, Any] | None:
    """`params` validated for `type_name` with every default filled in, or None after reporting why not.
    `block` is "optimizer" or "scheduler"; `type_name` is already canonical."""
    model = (OPTIMIZER_PARAMS if block == "optimizer" else SCHEDULER_PARAMS)[type_name]
    try:
        resolved = model.model_validate(params).model_dump()
    except ValidationError as error:
        problems.extend(describe_validation_error(error, prefix=f"{block}.params"))
        return None
    if type_name == "AdamW" and not resolved["adam_w_mode"]:
        problems.append(
            "optimizer.params.adam_w_mode false contradicts optimizer.type 'AdamW', which always decouples "
            "weight decay; use type 'Adam' for L2-coupled weight decay"
        )
        return None
    return resolved
