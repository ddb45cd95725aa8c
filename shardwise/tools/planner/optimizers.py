"""The optimizer an estimate prices, from the registry (shardwise/runtime/optim/registry.py):
named as on the command line, in lower case (`--optimizer adam`, `onebitlamb`), with K
for the params an estimate assumes."""

from __future__ import annotations

from shardwise.runtime.optim.registry import OptimizerSpec, optimizer_spec, optimizer_specs

# K of SGD and LARS counts a momentum buffer only when momentum is on; the estimate assumes
# it is, as they are trained in practice.
ASSUMED_PARAMS = {"momentum": 0.9}


def optimizer_names() -> list[str]:
    """The registered optimizers, lower case, in the registry's order."""
    return [spec.name.lower() for spec in optimizer_specs()]


def planned_optimizer(name: str) -> OptimizerSpec:
    """The registered optimizer `name` (any letter case)."""
    try:
        return optimizer_spec(name, any_case=True)
    except ValueError:
        raise ValueError(f"optimizer must be one of {', '.join(optimizer_names())}, got {name!r}") from None


def planned_state_bytes(name: str, dtype: str, *, bf16_masters: bool = False) -> float:
    """K: the optimizer's state bytes per parameter with `ASSUMED_PARAMS`, the fp32 master
    copy included when training in 16 bits (`bf16_masters`: bf16 states, no master)."""
    return planned_optimizer(name).state_bytes_per_param(ASSUMED_PARAMS, dtype, bf16_masters=bf16_masters)
