"""Optimizers by the names a DeepSpeed config uses, each with what the engine must know of it.

An entry says how to build the optimizer over the rank's fp32 segments, how many fp32
tensors of state it keeps per parameter (K = 4 x that, plus 4 for the master copy in
16-bit training: docs/formulas.md#optimizer-state-bytes-k), and how its state is saved and resharded (its codec). Adding
an optimizer is one `register_optimizer` call in the module that implements it, not a
branch in the engine.

Torch is imported only when an optimizer is built, so the report and the planner, which
need only K, stay free of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from shardwise.runtime.optim.codec import ElementwiseCodec, StateCodec
from shardwise.formulas.memory import OPTIMIZER_FP32_STATES

if TYPE_CHECKING:
    import torch

MASTER_WEIGHT_BYTES = 4
# DeepSpeed's Adam keys that choose the torch class or are fixed by it (not constructor arguments).
ADAM_SELECTOR_PARAMS = ("adam_w_mode", "torch_adam", "bias_correction")


@dataclass(frozen=True)
class OptimizerSpec:
    name: str  # the config's `optimizer.type`
    build: Callable[[list[dict[str, Any]], dict[str, Any]], "torch.optim.Optimizer"]
    # fp32 state tensors per parameter, given `params` (their byte equivalent / 4 where the
    # state is not fp32 per element: 8-bit codes, factored statistics)
    fp32_states: Callable[[dict[str, Any]], float]
    codec: StateCodec = field(default_factory=ElementwiseCodec)
    per_parameter: bool = False  # needs whole-parameter statistics (optim/sharded.py)

    def state_bytes_per_param(self, params: dict[str, Any], dtype: str) -> float:
        """K: state bytes per parameter, with the fp32 master copy when training in 16 bits."""
        master = 0 if dtype == "fp32" else MASTER_WEIGHT_BYTES
        return 4 * self.fp32_states(params) + master


_REGISTRY: dict[str, OptimizerSpec] = {}


def register_optimizer(spec: OptimizerSpec) -> None:
    if spec.name in _REGISTRY:
        raise ValueError(f"optimizer {spec.name!r} is registered twice")
    _REGISTRY[spec.name] = spec


def optimizer_spec(name: str) -> OptimizerSpec:
    if name not in _REGISTRY:
        raise ValueError(f"no optimizer {name!r}; registered: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def registered_optimizers() -> list[str]:
    return sorted(_REGISTRY)


# -- torch's own optimizers, as DeepSpeed configs name them --------------------------------
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


def _build_torch(type_name: str) -> Callable[[list[dict[str, Any]], dict[str, Any]], "torch.optim.Optimizer"]:
    """torch's fused kernel exists on CPU and CUDA for all three."""

    def build(groups: list[dict[str, Any]], params: dict[str, Any]) -> "torch.optim.Optimizer":
        import torch

        cls = getattr(torch.optim, torch_class_name(type_name, params))
        return cls(groups, fused=True, **constructor_kwargs(params))

    return build


def _build_lamb(groups: list[dict[str, Any]], params: dict[str, Any]) -> "torch.optim.Optimizer":
    from shardwise.runtime.optim.lamb import Lamb

    # amsgrad is validated false; bias_correction is a Lamb argument (for Adam it selects the class)
    kwargs = {key: value for key, value in params.items() if key != "amsgrad"}
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    return Lamb(groups, **kwargs)


Build = Callable[[list[dict[str, Any]], dict[str, Any]], "torch.optim.Optimizer"]


def _build_shardwise(module: str, class_name: str) -> Build:
    """One of shardwise's own optimizers, its config params passed as constructor arguments."""

    def build(groups: list[dict[str, Any]], params: dict[str, Any]) -> "torch.optim.Optimizer":
        import importlib

        cls = getattr(importlib.import_module(f"shardwise.runtime.optim.{module}"), class_name)
        return cls(groups, **constructor_kwargs(params))

    return build


class _CodecBesideOptimizer:
    """The codec an optimizer module defines (it imports torch), loaded on first use."""

    def __init__(self, module: str, class_name: str):
        self._where = (module, class_name)
        self._codec: StateCodec | None = None

    def _load(self) -> StateCodec:
        if self._codec is None:
            import importlib

            module, class_name = self._where
            self._codec = getattr(importlib.import_module(f"shardwise.runtime.optim.{module}"), class_name)()
        return self._codec

    def encode(self, state: dict[str, Any], numel: int) -> tuple[dict[str, "torch.Tensor"], dict[str, Any]]:
        return self._load().encode(state, numel)

    def decode(self, elements: dict[str, "torch.Tensor"], scalars: dict[str, Any]) -> dict[str, Any]:
        return self._load().decode(elements, scalars)

    def state_bytes(self, state: dict[str, Any], numel: int) -> int:
        return self._load().state_bytes(state, numel)


register_optimizer(OptimizerSpec("Adam", _build_torch("Adam"), fp32_states=lambda params: 2))
register_optimizer(OptimizerSpec("AdamW", _build_torch("AdamW"), fp32_states=lambda params: 2))
# torch's SGD allocates a momentum buffer only when momentum is on
register_optimizer(OptimizerSpec("SGD", _build_torch("SGD"), fp32_states=lambda params: int(params.get("momentum", 0) > 0)))
register_optimizer(OptimizerSpec("Lamb", _build_lamb, fp32_states=lambda params: 2, per_parameter=True))
register_optimizer(OptimizerSpec("Lars", _build_shardwise("lars", "Lars"), per_parameter=True,
                                 fp32_states=lambda params: int(params.get("momentum", 0) > 0)))
# K of the shape-dependent optimizers: the planner's (shardwise/formulas/memory.py), whose values assume
# typical shapes; the engine counts the exact bytes through each codec's `state_bytes`.
register_optimizer(OptimizerSpec("Adafactor", _build_shardwise("adafactor", "Adafactor"), per_parameter=True,
                                 fp32_states=lambda params: OPTIMIZER_FP32_STATES["adafactor"],
                                 codec=_CodecBesideOptimizer("adafactor", "AdafactorCodec")))
register_optimizer(OptimizerSpec("Adam8bit", _build_shardwise("adam8bit", "Adam8bit"), per_parameter=True,
                                 fp32_states=lambda params: OPTIMIZER_FP32_STATES["adam8bit"],
                                 codec=_CodecBesideOptimizer("adam8bit", "Adam8bitCodec")))
register_optimizer(OptimizerSpec("AdamW8bit", _build_shardwise("adam8bit", "AdamW8bit"), per_parameter=True,
                                 fp32_states=lambda params: OPTIMIZER_FP32_STATES["adamw8bit"],
                                 codec=_CodecBesideOptimizer("adam8bit", "Adam8bitCodec")))
register_optimizer(OptimizerSpec("Muon", _build_shardwise("muon", "Muon"), per_parameter=True,
                                 fp32_states=lambda params: OPTIMIZER_FP32_STATES["muon"],
                                 codec=_CodecBesideOptimizer("muon", "MuonCodec")))
# 1-bit Adam / LAMB (stage 0): momentum, variance (LAMB: also its fresh variance) and the
# worker-side error per element; the server-side error (1/N of the elements) and the momentum
# buffer's padding are counted through the optimizer (shardwise/formulas/memory.py onebit_state_bytes).
def _build_onebit(module: str, class_name: str) -> Build:
    """`bias_correction` is one of their constructor arguments (Adam's config key selects)."""

    def build(groups: list[dict[str, Any]], params: dict[str, Any]) -> "torch.optim.Optimizer":
        import importlib

        cls = getattr(importlib.import_module(f"shardwise.runtime.optim.{module}"), class_name)
        return cls(groups, **{**params, "betas": tuple(params.get("betas", (0.9, 0.999)))})

    return build


register_optimizer(OptimizerSpec("OneBitAdam", _build_onebit("onebit_adam", "OneBitAdam"), per_parameter=True,
                                 fp32_states=lambda params: OPTIMIZER_FP32_STATES["onebitadam"],
                                 codec=_CodecBesideOptimizer("onebit", "OneBitCodec")))
register_optimizer(OptimizerSpec("OneBitLamb", _build_onebit("onebit_lamb", "OneBitLamb"), per_parameter=True,
                                 fp32_states=lambda params: OPTIMIZER_FP32_STATES["onebitlamb"],
                                 codec=_CodecBesideOptimizer("onebit", "OneBitCodec")))
