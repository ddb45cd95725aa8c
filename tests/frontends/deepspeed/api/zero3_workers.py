"""Rank functions for test_zero3_attributes.py (2 ranks): what ZeRO-3 code written for
DeepSpeed reads on parameters."""

from __future__ import annotations

import torch
from torch import nn

import shardwise.frontends.deepspeed.api as deepspeed
from shardwise.frontends.deepspeed.api.runtime.zero.partition_parameters import ZeroParamStatus


def attributes(rank: int, world_size: int, stage: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    shapes = {name: tuple(param.shape) for name, param in model.named_parameters()}
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 8}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    params = dict(model.named_parameters())
    report = {"has_id": {name: hasattr(p, "ds_id") for name, p in params.items()}}
    if stage != 3:
        return report
    report["ids_distinct"] = len({p.ds_id for p in params.values()}) == len(params)
    report["ds_shape"] = {name: tuple(p.ds_shape) for name, p in params.items()}
    report["ds_numel"] = {name: p.ds_numel for name, p in params.items()}
    report["ds_persist"] = {name: p.ds_persist for name, p in params.items()}
    report["shapes"] = shapes
    report["outside"] = {name: p.ds_status for name, p in params.items()}
    with deepspeed.zero.GatheredParameters([params["0.weight"]]):
        report["inside"] = params["0.weight"].ds_status
        report["inside_shape"] = tuple(params["0.weight"].shape)
    report["after"] = params["0.weight"].ds_status
    # DeepSpeed-Chat's filter: gather only what is not available
    report["to_fetch"] = sorted(name for name, p in params.items()
                                if hasattr(p, "ds_id") and p.ds_status == ZeroParamStatus.NOT_AVAILABLE)
    engine.backward(engine(torch.randn(2, 16)).sum())
    engine.step()
    report["after_step"] = params["0.weight"].ds_status
    engine.empty_partition_cache()
    engine.destroy()
    report["destroyed"] = {name: hasattr(p, "ds_id") or type(p) is not nn.Parameter for name, p in params.items()}
    return report


def edits_under_init(rank: int, world_size: int) -> dict:
    """Modules built inside `zero.Init` with a different seed on each rank, edited on rank 0
    inside `GatheredParameters(modifier_rank=0)` before any engine holds them (Hugging Face's
    ZeRO-3 loader), beside a module built outside `Init`."""
    torch.manual_seed(10 + rank)
    with deepspeed.zero.Init():
        inside = nn.Linear(4, 3)
    outside = nn.Linear(4, 3)
    with deepspeed.zero.GatheredParameters(list(inside.parameters()) + list(outside.parameters()), modifier_rank=0):
        if rank == 0:
            with torch.no_grad():
                inside.weight.add_(1.0)
    return {"inside": {n: p.detach().clone() for n, p in inside.named_parameters()},
            "outside": {n: p.detach().clone() for n, p in outside.named_parameters()}}
