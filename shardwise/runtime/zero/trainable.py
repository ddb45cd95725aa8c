"""Which parameters train, under which name, in which optimizer param group.

Tied weights (one `Parameter` reachable under two names, as in GPT-2's embedding and
output layer) are trained once, under the first name `named_parameters()` gives.
"""

from __future__ import annotations

import torch
from torch import nn


def trainable_parameters(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> list[tuple[str, nn.Parameter, int]]:
    """(name, parameter, param-group index) for every parameter that requires grad."""
    group_of: dict[int, int] = {}
    if optimizer is not None:
        for index, group in enumerate(optimizer.param_groups):
            for param in group["params"]:
                if id(param) in group_of:
                    raise ValueError(
                        f"a parameter appears in optimizer param groups {group_of[id(param)]} "
                        f"and {index}; give each parameter to one group"
                    )
                group_of[id(param)] = index
    trainable = []
    in_model: set[int] = set()
    for name, param in model.named_parameters():
        in_model.add(id(param))
        if not param.requires_grad:
            continue
        if not param.is_floating_point():
            raise ValueError(f"parameter {name} requires grad but has dtype {param.dtype}")
        if optimizer is not None and id(param) not in group_of:
            raise ValueError(
                f"parameter {name} requires grad but is in no param group of the optimizer; "
                "build the optimizer over model.parameters() or freeze it (requires_grad=False)"
            )
        trainable.append((name, param, group_of.get(id(param), 0)))
    missing = [pid for pid in group_of if pid not in in_model]
    if missing:
        raise ValueError(
            f"the optimizer holds {len(missing)} tensor(s) that are not parameters of the model"
        )
    if not trainable:
        raise ValueError("the model has no parameter with requires_grad=True")
    return trainable


def frozen_parameters(
    model: nn.Module, trained: list[tuple[str, nn.Parameter, int]]
) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of every floating-point parameter not in `trained`."""
    ids = {id(param) for _, param, _ in trained}
    return [(name, param) for name, param in model.named_parameters() if param.is_floating_point() and id(param) not in ids]


def evaluated_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter, int]]:
    """(name, parameter, 0) for every floating-point parameter, trainable or not: an
    engine without an optimizer only runs forward, and holds all of them the way ZeRO
    holds trained ones (whole at stages 0-2, 1/N each at stage 3), as DeepSpeed does for
    a model it was given no optimizer for."""
    named = [(name, param, 0) for name, param in model.named_parameters() if param.is_floating_point()]
    if not named:
        raise ValueError("the model has no floating-point parameter")
    return named
