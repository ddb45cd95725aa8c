"""Splitting a model into this rank's pipeline stage: the "pipeline" step of a model's
`parallelize` (shardwise/models/), the last before ZeRO.

The engine then runs the stage with `engine.train_batch(data_iter)` / `eval_batch`
(runner.py): each `next(data_iter)` is one micro-batch on every rank of the pipeline
(each stage reads its shape; the first its token ids, the last its labels): a dict of the
model's forward keyword arguments (`input_ids` and `labels` for a Hugging Face model, `idx`
and `targets` for shardwise's GPT; the loss is the model's own) or an `(inputs, labels)`
pair with a `loss_fn(logits, labels)`, as DeepSpeed's `PipelineModule` takes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardwise.runtime.distributed.collectives import Communicator
from shardwise.runtime.distributed.mesh import GroupHandle
from shardwise.runtime.parallel.pipeline.adapter import Adapter
from shardwise.runtime.parallel.pipeline.policy import PipelinePolicy
from shardwise.runtime.parallel.pipeline.split import StageLayout, split_model
from shardwise.runtime.parallel.pipeline.timing import agreed_costs, measure_layer_costs

SPLIT = "_shardwise_pipeline"  # on a split model: (its adapter, this rank's StageLayout)


def split_pipeline(model: nn.Module, adapter: Adapter, *, pipeline: GroupHandle, policy: PipelinePolicy,
                   micro_batch_size: int, world: Communicator | None = None) -> nn.Module:
    """Keep this rank's layers; the model's own forward is replaced by a clear error, since
    a stage alone cannot run it. The "time" partition measures every layer on this rank
    and uses rank 0's numbers, agreed over `world`."""
    costs = None
    if policy.partition == "time" and policy.split_points is None:
        measured = measure_layer_costs(model, adapter, micro_batch_size, policy.profile_seq_len)
        costs = agreed_costs(measured, world)
    split_points = list(policy.split_points) if policy.split_points is not None else None
    layout = split_model(model, adapter, rank=pipeline.rank, size=pipeline.size, virtual=policy.virtual_stages,
                         rule=policy.partition, split_points=split_points, costs=costs)
    setattr(model, SPLIT, (adapter, layout))
    model.forward = _stage_forward_refused
    return model


def stage_of(model: nn.Module) -> tuple[Adapter, StageLayout] | None:
    """(adapter, layout) of a model `split_pipeline` split, else None."""
    return getattr(model, SPLIT, None)


def _stage_forward_refused(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError("with pipeline_parallel.size > 1 each rank holds only its stage's layers: train with "
                       "engine.train_batch(data_iter) and evaluate with engine.eval_batch(data_iter)")


def keep_stage_parameters(optimizer: torch.optim.Optimizer | None, model: nn.Module) -> torch.optim.Optimizer | None:
    """An optimizer built over the whole model keeps only this stage's parameters."""
    if optimizer is None or stage_of(model) is None:
        return optimizer
    kept = {id(param) for param in model.parameters()}
    for group in optimizer.param_groups:
        group["params"] = [param for param in group["params"] if id(param) in kept]
    return optimizer
