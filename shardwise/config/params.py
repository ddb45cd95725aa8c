"""The `params` of the `optimizer` and `scheduler` blocks, one model per `type`.

DeepSpeed passes `params` straight to the optimizer or scheduler constructor, so
which keys are valid depends on `type`. Defaults are those of the code DeepSpeed
runs: its Adam path (`FusedAdam` / `torch.optim.Adam(W)` with `adam_w_mode`
defaulting to True, i.e. decoupled weight decay even for type "Adam"),
`torch.optim.SGD`, and the classes in deepspeed/runtime/lr_schedules.py (whose
constructor defaults differ from its argparse defaults; the constructors win).
"""

from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from shardwise.config.errors import describe_validation_error
from shardwise.config.fields import Bool, Float, Int, Section


def _check_betas(betas: tuple[float, float]) -> tuple[float, float]:
    if not all(0.0 <= beta < 1.0 for beta in betas):
        raise ValueError(f"betas {list(betas)} must each lie in [0, 1)")
    return betas


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
    """LAMB with DeepSpeed's FusedLamb parameters and defaults (shardwise.optim.Lamb)."""

    lr: Float = Field(1e-3, ge=0)
    betas: tuple[Float, Float] = (0.9, 0.999)
    eps: Float = Field(1e-8, gt=0)
    weight_decay: Float = Field(0.0, ge=0)
    bias_correction: Bool = True
    eps_inside_sqrt: Bool = False
    max_coeff: Float = Field(10.0, ge=0)
    min_coeff: Float = Field(0.01, ge=0)
    amsgrad: Bool = False

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


class SGDParams(Section):
    """`torch.optim.SGD`, which DeepSpeed builds for any type it does not know itself."""

    lr: Float = Field(1e-3, ge=0)
    momentum: Float = Field(0.0, ge=0)
    dampening: Float = 0.0
    weight_decay: Float = Field(0.0, ge=0)
    nesterov: Bool = False

    @model_validator(mode="after")
    def _nesterov_needs_momentum(self) -> "SGDParams":
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError(
                f"nesterov needs momentum > 0 and dampening 0, got momentum {self.momentum} "
                f"and dampening {self.dampening}"
            )
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
    "Adam": AdamParams, "AdamW": AdamParams, "SGD": SGDParams, "Lamb": LambParams,
}
SCHEDULER_PARAMS: dict[str, type[Section]] = {
    "WarmupLR": WarmupLRParams,
    "WarmupDecayLR": WarmupDecayLRParams,
    "WarmupCosineLR": WarmupCosineLRParams,
}

# Types from SPEC §1 that later capabilities (C16-C18) add; DeepSpeed's own spellings included.
OPTIMIZERS_NOT_YET = ("Lars", "Adafactor", "Adam8bit", "OneBitAdam", "OneBitLamb", "ZeroOneAdam")
# Types DeepSpeed builds itself that no shardwise capability covers.
DEEPSPEED_OPTIMIZERS_UNSUPPORTED = ("Adagrad", "Lion", "Muon", "MuAdam", "MuAdamW", "MuSGD")
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
