"""`deepspeed.moe.utils`: telling expert parameters apart, and putting them in param groups
of their own, as DeepSpeed's examples do before building the optimizer
(`create_moe_param_groups` in DeepSpeedExamples' cifar10_deepspeed.py)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["configure_moe_param_groups", "has_moe_layers", "is_moe_param", "is_moe_param_group",
           "split_params_grads_into_shared_and_expert_params", "split_params_into_different_moe_groups_for_optimizer",
           "split_params_into_shared_and_expert_params"]

DEFAULT_MAX_GROUP_SIZE = 178956971  # DeepSpeed's default, in elements


def is_moe_param(param: torch.Tensor) -> bool:
    """An expert's parameter (`Experts` marks them `allreduce = False`)."""
    return hasattr(param, "allreduce") and not param.allreduce


def has_moe_layers(model: nn.Module) -> tuple[bool, int]:
    """(whether `model` has a `MoE` layer, the first one's number of experts; 0 without)."""
    from shardwise.frontends.deepspeed.api.moe.layer import MoE

    layer = next((module for module in model.modules() if isinstance(module, MoE)), None)
    return (layer is not None, layer.num_experts if layer is not None else 0)


def split_params_into_shared_and_expert_params(params: list[nn.Parameter]) -> tuple[list[nn.Parameter],
                                                                                   list[nn.Parameter]]:
    shared = [param for param in params if not is_moe_param(param)]
    return shared, [param for param in params if is_moe_param(param)]


def split_params_grads_into_shared_and_expert_params(group: list[nn.Parameter]) -> tuple[list[torch.Tensor],
                                                                                         list[torch.Tensor]]:
    """The gradients of a group's dense and expert parameters apart (each in its
    parameter's dtype), for norms and overflow checks; parameters without one are left out."""
    shared = [param.grad.to(param.dtype) for param in group if param.grad is not None and not is_moe_param(param)]
    return shared, [param.grad.to(param.dtype) for param in group if param.grad is not None and is_moe_param(param)]


def is_moe_param_group(param_group: dict[str, Any]) -> bool:
    return param_group.get("moe", False)


def configure_moe_param_groups(model_parameters: list) -> list[dict[str, Any]]:
    """Param groups with the experts in groups of their own: from parameters (one
    "dense-params" group first), or from groups that have no MoE group yet; groups that
    already have them are returned as they are."""
    if not isinstance(model_parameters, list):
        raise AssertionError("model_parameters must be a list")
    for item in model_parameters:
        if not isinstance(item, (torch.Tensor, dict)):
            raise TypeError("param argument that would be given to the optimizer should be an iterable of Tensors "
                            f"or dicts, but got {type(item)}")
    if isinstance(model_parameters[0], nn.Parameter):
        return split_params_into_different_moe_groups_for_optimizer({"params": model_parameters,
                                                                     "name": "dense-params"})
    if not any("moe" in group for group in model_parameters):
        return split_params_into_different_moe_groups_for_optimizer(model_parameters)
    return model_parameters


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
