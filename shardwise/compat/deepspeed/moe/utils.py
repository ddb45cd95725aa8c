"""`deepspeed.moe.utils`: the param-group helpers DeepSpeed's examples import.

shardwise has no mixture-of-experts layers, so a model it trains has no expert
parameters and these helpers return the groups they are given, as DeepSpeed's do for a
model without experts. A parameter marked as an expert's (DeepSpeed's MoE layers set
`param.allreduce = False`) is refused: shardwise would reduce its gradient over every
rank, which is not what an expert-parallel layer needs.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["is_moe_param", "split_params_into_different_moe_groups_for_optimizer"]


def is_moe_param(param: torch.Tensor) -> bool:
    return getattr(param, "allreduce", True) is False


def split_params_into_different_moe_groups_for_optimizer(
    param_groups: dict[str, Any] | tuple[dict[str, Any], ...] | list[dict[str, Any]],
    max_group_size: int | float | None = None,
) -> list[dict[str, Any]]:
    """The param groups as a list (a single dict becomes a one-group list)."""
    if isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    elif not isinstance(param_groups, list):
        raise ValueError(f"expected a param group dict, or a list or tuple of them, got {type(param_groups).__name__}")
    for group in param_groups:
        group["params"] = list(group["params"])
        if any(is_moe_param(param) for param in group["params"]):
            raise ValueError("a parameter is marked as a mixture-of-experts expert's (allreduce=False); shardwise "
                             "has no expert parallelism: train the model without DeepSpeed's MoE layers")
    return param_groups
