"""`deepspeed.moe.utils`: telling expert parameters apart, and putting them in param groups
of their own, as DeepSpeed's examples do before building the optimizer
(`create_moe_param_groups` in DeepSpeedExamples' cifar10_deepspeed.py)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["is_moe_param", "split_params_into_different_moe_groups_for_optimizer"]

DEFAULT_MAX_GROUP_SIZE = 178956971  # DeepSpeed's default, in elements


def is_moe_param(param: torch.Tensor) -> bool:
    """An expert's parameter (`Experts` marks them `allreduce = False`)."""
    return getattr(param, "allreduce", True) is False


def split_params_into_different_moe_groups_for_optimizer(
    param_groups: dict[str, Any] | tuple[dict[str, Any], ...] | list[dict[str, Any]],
    max_group_size: int | float | None = DEFAULT_MAX_GROUP_SIZE,
) -> list[dict[str, Any]]:
    """The groups with their expert parameters moved out: each group keeps its dense
    parameters, and for each expert group name its experts' parameters follow in new
    groups with the same hyper-parameters, `"name"` set to the expert group's and
    `"moe": True`, cut at `max_group_size` elements. Groups left empty are dropped."""
    if isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    elif not isinstance(param_groups, list):
        raise ValueError(f"expected a param group dict, or a list or tuple of them, got {type(param_groups).__name__}")
    expert_groups: list[dict[str, Any]] = []
    for group in param_groups:
        params = list(group["params"])
        group["params"] = [param for param in params if not is_moe_param(param)]
        by_name: dict[str, list[torch.Tensor]] = {}
        for param in params:
            if is_moe_param(param):
                by_name.setdefault(getattr(param, "group_name", "experts"), []).append(param)
        hyper = {key: value for key, value in group.items() if key not in ("params", "name")}
        for name, expert_params in by_name.items():
            for chunk in _cut(expert_params, max_group_size):
                expert_groups.append({**hyper, "name": name, "moe": True, "params": chunk})
    return [group for group in param_groups if group["params"]] + expert_groups


def _cut(params: list[torch.Tensor], max_group_size: int | float | None) -> list[list[torch.Tensor]]:
    if not max_group_size:
        return [params]
    chunks: list[list[torch.Tensor]] = [[]]
    size = 0
    for param in params:
        if chunks[-1] and size + param.numel() > max_group_size:
            chunks.append([])
            size = 0
        chunks[-1].append(param)
        size += param.numel()
    return chunks
