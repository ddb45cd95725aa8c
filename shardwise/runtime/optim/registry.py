"""Optimizers by the names a DeepSpeed config uses, each with what the rest of shardwise
must know of it.

Each optimizer is one file of this folder that defines the optimizer and, at import,
registers its `OptimizerSpec`: its config name, its params (optim/params.py), how to
build it over the rank's fp32 segments, how many fp32 tensors of state it keeps per
parameter (K = 4 x that, plus 4 for the master copy in 16-bit training:
docs/formulas.md#optimizer-state-bytes-k), how its state is saved and resharded (its
codec), and where it runs. The engine, the config front end, the planner and
`shardwise train` read all of that from here; none of them lists optimizers.
optim/__init__.py imports the built-in optimizer files, in the order the config
reference lists them; adding an optimizer is a new file and its line there
(docs/optimizers.md#adding-an-optimizer).

Reading the registry imports torch: an optimizer's file defines a `torch.optim.Optimizer`,
and keeping its spec in the same file is what makes adding one a single file. So
`shardwise estimate`, which needs K, and config validation, which needs the params,
import torch (about 1 s; when this was written every `shardwise` command imported it
already, through the launcher).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Callable

from shardwise.formulas.memory import StateTerm, optimizer_state_bytes
from shardwise.runtime.optim.codec import ElementwiseCodec, StateCodec

if TYPE_CHECKING:
    import torch

Build = Callable[[list[dict[str, Any]], dict[str, Any]], "torch.optim.Optimizer"]
ZERO_STAGES = (0, 1, 2, 3)


def accepted_params(declaration: type, given: dict[str, Any]) -> dict[str, Any]:
    """The keys of `given` that `declaration` (a params dataclass) accepts."""
    names = {field.name for field in fields(declaration)}
    return {key: value for key, value in given.items() if key in names}


@dataclass(frozen=True)
class OptimizerSpec:
    """What shardwise knows of one config optimizer.

    `build(groups, params)` makes it over param groups from resolved `params` (every key
    of `params_declaration`, defaults filled in). `fp32_states(params)` is its fp32 state
    tensors per parameter (their byte equivalent / 4 where the state is not fp32 per
    element: 8-bit codes, factored statistics); the engine counts the exact bytes through
    `codec.state_bytes`. `per_parameter`: it needs whole-parameter statistics
    (optim/sharded.py). `zero_stages` and `offload` say where it runs (the planner offers
    nothing else; `shardwise train` picks its highest stage). `state_terms(stage, dtype, grad_dtype)`:
    for an optimizer whose states do not all partition like ZeRO's, its own model-state
    summands (formulas/memory.py `StateTerm`). `check_params(params)` raises ValueError,
    its message starting with the key it concerns, for a rule the declaration cannot
    state (one shared by several types). `main_job_params(adamw, steps)`: its params for
    `shardwise train --optimizer`, a run of `steps` steps that would otherwise train with
    AdamW's `adamw` (default: the keys of `adamw` it accepts).
    """

    name: str
    params_declaration: type
    build: Build
    fp32_states: Callable[[dict[str, Any]], float]
    codec: StateCodec = ElementwiseCodec()
    per_parameter: bool = False
    zero_stages: tuple[int, ...] = ZERO_STAGES
    offload: bool = True
    state_terms: Callable[[int, str], list[StateTerm]] | None = None
    check_params: Callable[[dict[str, Any]], None] | None = None
    main_job_params: Callable[[dict[str, Any], int], dict[str, Any]] | None = None

    def state_bytes_per_param(self, params: dict[str, Any], dtype: str, *, bf16_masters: bool = False) -> float:
        """K: state bytes per parameter, with the fp32 master copy when training in 16 bits
        (`bf16_masters`: none, and the states in bf16)."""
        return optimizer_state_bytes(self.fp32_states(params), dtype, bf16_masters=bf16_masters)

    def params_for_main_job(self, adamw: dict[str, Any], steps: int) -> dict[str, Any]:
        if self.main_job_params is not None:
            return self.main_job_params(adamw, steps)
        return accepted_params(self.params_declaration, adamw)


_REGISTRY: dict[str, OptimizerSpec] = {}


def register_optimizer(spec: OptimizerSpec) -> OptimizerSpec:
    """Add `spec` under its config name; a name differing only in case is the same name
    (configs match optimizer types case-insensitively, as DeepSpeed does)."""
    if spec.name.lower() in (name.lower() for name in _REGISTRY):
        raise ValueError(f"optimizer {spec.name!r} is registered twice")
    _REGISTRY[spec.name] = spec
    return spec


def optimizer_spec(name: str, *, any_case: bool = False) -> OptimizerSpec:
    """The spec registered as `name` (`any_case`: or as the same name in other letter case,
    as the command line's lower-case names give it); else, for the exact name of a
    `torch.optim` class, that class (optim/torch_by_name.py, as DeepSpeed builds it)."""
    from shardwise.runtime.optim.torch_by_name import torch_optimizer_spec

    if not any_case and name in _REGISTRY:
        return _REGISTRY[name]
    if any_case:
        for registered, spec in _REGISTRY.items():
            if registered.lower() == name.lower():
                return spec
    by_name = torch_optimizer_spec(name)
    if by_name is not None:
        return by_name
    raise ValueError(f"no optimizer {name!r}; registered: {', '.join(registered_optimizers())}, or a torch.optim "
                     "class by its exact name")


def registered_optimizers() -> list[str]:
    """Registered names, sorted."""
    return sorted(_REGISTRY)


def optimizer_specs() -> tuple[OptimizerSpec, ...]:
    """Every registered spec, in registration order (the built-ins: optim/__init__.py's)."""
    return tuple(_REGISTRY.values())
