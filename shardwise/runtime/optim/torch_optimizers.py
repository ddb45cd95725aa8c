"""torch's own optimizers as DeepSpeed configs name them: Adam, AdamW, SGD and Adagrad (Adam with
`bias_correction` false is optim/adam_uncorrected.py, since torch's Adam always corrects).

Defaults are those of the code DeepSpeed runs: its Adam path (`FusedAdam` /
`torch.optim.Adam(W)` with `adam_w_mode` defaulting to True, i.e. decoupled weight decay
even for type "Adam") and `torch.optim.SGD`, which DeepSpeed builds for any type it does
not know itself, and `torch.optim.Adagrad`, which DeepSpeed builds for "Adagrad" (its
`DeepSpeedCPUAdagrad` with the optimizer offloaded computes the same update). torch's
fused kernel exists on CPU and CUDA for Adam, AdamW and SGD; Adagrad takes torch's
default (multi-tensor) implementation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from shardwise.runtime.optim.adam_uncorrected import UncorrectedAdam
from shardwise.runtime.optim.params import check_betas, check_nesterov, param
from shardwise.runtime.optim.registry import OptimizerSpec, register_optimizer

# DeepSpeed's Adam keys that choose the torch class or are fixed by it (not constructor arguments).
ADAM_SELECTOR_PARAMS = ("adam_w_mode", "torch_adam", "bias_correction")


@dataclass(frozen=True)
class AdamParams:
    """Adam and AdamW; shardwise builds them with `torch.optim` (without bias correction:
    optim/adam_uncorrected.py, DeepSpeed's kernel's update)."""

    lr: float = param(1e-3, ge=0)
    betas: tuple[float, float] = param((0.9, 0.999), check=check_betas)
    eps: float = param(1e-8, gt=0)
    weight_decay: float = param(0.0, ge=0)
    amsgrad: bool = False
    adam_w_mode: bool = True
    torch_adam: Any = param(False, description="DeepSpeed's switch from its fused kernel to torch.optim; accepted "
                            "so DeepSpeed configs load, without effect because shardwise always uses torch.optim. "
                            "Any value: DeepSpeed reads it as Python's truth (optimum-habana writes \"torch_impl\")")
    bias_correction: bool = param(True, description="false: DeepSpeed's Adam without bias correction (the "
                                  "first steps use the raw moments), as BERT-era configs ask")

    def __post_init__(self) -> None:
        if self.amsgrad and not self.bias_correction:
            raise ValueError("amsgrad with bias_correction false: DeepSpeed's Adam has no amsgrad, and torch's "
                             "always corrects bias; use one of them")


@dataclass(frozen=True)
class SGDParams:
    """`torch.optim.SGD`, which DeepSpeed builds for any type it does not know itself."""

    lr: float = param(1e-3, ge=0)
    momentum: float = param(0.0, ge=0)
    dampening: float = 0.0
    weight_decay: float = param(0.0, ge=0)
    nesterov: bool = False

    def __post_init__(self) -> None:
        check_nesterov(self.nesterov, self.momentum, self.dampening)


@dataclass(frozen=True)
class AdagradParams:
    """`torch.optim.Adagrad`'s arguments and defaults, which DeepSpeed passes the params to
    (weight decay added to the gradient, as torch and DeepSpeed's CPU op both do)."""

    lr: float = param(1e-2, ge=0)
    lr_decay: float = param(0.0, ge=0)
    weight_decay: float = param(0.0, ge=0)
    initial_accumulator_value: float = param(0.0, ge=0)
    eps: float = param(1e-10, ge=0)


def torch_class_name(type_name: str, params: dict[str, Any]) -> str:
    """The `torch.optim` class a config optimizer means: DeepSpeed's "Adam" decouples
    weight decay (AdamW) unless `adam_w_mode` is false."""
    if type_name not in ("Adam", "AdamW"):
        return type_name
    return "AdamW" if params.get("adam_w_mode", True) else "Adam"


def constructor_kwargs(params: dict[str, Any]) -> dict[str, Any]:
    """`params` minus the keys that select the class rather than configure it."""
    kwargs = {key: value for key, value in params.items() if key not in ADAM_SELECTOR_PARAMS}
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    return kwargs


def _decoupled(params: dict[str, Any]) -> None:
    if not params.get("adam_w_mode", True):
        raise ValueError("adam_w_mode false contradicts optimizer.type 'AdamW', which always decouples weight "
                         "decay; use type 'Adam' for L2-coupled weight decay")


def _register(type_name: str, declaration: type, fp32_states: Any, **options: Any) -> None:
    def build(groups: list[dict[str, Any]], params: dict[str, Any]) -> torch.optim.Optimizer:
        if not params.get("bias_correction", True):
            kwargs = {key: value for key, value in constructor_kwargs(params).items() if key != "amsgrad"}
            return UncorrectedAdam(groups, adam_w_mode=torch_class_name(type_name, params) == "AdamW", **kwargs)
        cls = getattr(torch.optim, torch_class_name(type_name, params))
        return cls(groups, **constructor_kwargs(params), **({} if type_name == "Adagrad" else {"fused": True}))

    register_optimizer(OptimizerSpec(type_name, declaration, build, fp32_states=fp32_states, **options))


# K: Adam's momentum and variance; SGD allocates a momentum buffer only when momentum is on.
_register("Adam", AdamParams, lambda params: 2)
_register("AdamW", AdamParams, lambda params: 2, check_params=_decoupled)
_register("SGD", SGDParams, lambda params: int(params.get("momentum", 0) > 0))
_register("Adagrad", AdagradParams, lambda params: 1)  # the sum of squared gradients
