"""The pipeline's place in the engine: the apply step that splits the model, and the
DeepSpeed `PipelineEngine` calls `train_batch` / `eval_batch`.

    engine = shardwise.initialize(model, {"pipeline_parallel": {"size": 2, "schedule": "1f1b"},
                                          "gradient_accumulation_steps": 8, ...})
    loss = engine.train_batch(data_iter=batches)   # 8 micro-batches, one optimizer step

Each `next(data_iter)` is one micro-batch on every rank of the pipeline (each stage reads
its shape; the first its token ids, the last its labels): a dict of the model's forward
keyword arguments (`input_ids` and `labels` for a Hugging Face model, `idx` and `targets`
for shardwise's GPT; the loss is the model's own) or an `(inputs, labels)` pair with a
`loss_fn(logits, labels)`, as DeepSpeed's `PipelineModule` takes.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn

from shardwise.frontends.deepspeed.config import ShardwiseConfig
from shardwise.runtime.distributed.mesh import ParallelMesh
from shardwise.runtime.apply import ModelTransform, register_transform
from shardwise.runtime.parallel.pipeline.adapters import adapter_for
from shardwise.runtime.parallel.pipeline.runner import PipelineRunner
from shardwise.runtime.parallel.pipeline.split import StageLayout, split_model
from shardwise.runtime.parallel.pipeline.timing import agreed_costs, measure_layer_costs


def apply_pipeline_split(model: nn.Module, config: ShardwiseConfig, mesh: ParallelMesh) -> nn.Module:
    """Keep this rank's layers (the apply stage's "pipeline" step); the model's own forward
    is replaced by a clear error, since a stage alone cannot run it."""
    section = config.pipeline_parallel
    adapter = adapter_for(model)
    pipeline = mesh["pipeline"]
    costs = None
    if section.partition == "time" and section.split_points is None:
        measured = measure_layer_costs(model, adapter, config.train_micro_batch_size_per_gpu, section.profile_seq_len)
        costs = agreed_costs(measured, getattr(mesh, "world", None))
    layout = split_model(model, adapter, pipeline.rank, pipeline.size, section.virtual_stages,
                         section.partition, section.split_points, costs)
    model._shardwise_pipeline = (adapter, layout)
    model.forward = _stage_forward_refused
    return model


def _stage_forward_refused(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError("with pipeline_parallel.size > 1 each rank holds only its stage's layers: train with "
                       "engine.train_batch(data_iter) and evaluate with engine.eval_batch(data_iter)")


register_transform(ModelTransform("pipeline", lambda config: config.pipeline_parallel.size > 1, apply_pipeline_split))


def keep_stage_parameters(optimizer: torch.optim.Optimizer | None, model: nn.Module) -> torch.optim.Optimizer | None:
    """An optimizer built over the whole model keeps only this stage's parameters."""
    if optimizer is None or not hasattr(model, "_shardwise_pipeline"):
        return optimizer
    kept = {id(param) for param in model.parameters()}
    for group in optimizer.param_groups:
        group["params"] = [param for param in group["params"] if id(param) in kept]
    return optimizer


def attach_pipeline(engine: Any) -> PipelineRunner | None:
    """The engine's schedule runner, or None when the model is not split."""
    split = getattr(engine.module, "_shardwise_pipeline", None)
    if split is None:
        return None
    adapter, layout = split
    section = engine.config.pipeline_parallel
    return PipelineRunner(engine, adapter, layout, section.schedule, section.micro_batches)


class PipelineEngineMethods:
    """DeepSpeed's PipelineEngine calls, mixed into `shardwise.Engine`."""

    pipeline: PipelineRunner | None

    def train_batch(self, data_iter: Iterable[Any] | None = None,
                    loss_fn: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
        """Run `pipeline_parallel.micro_batches` micro-batches through the schedule, then one
        optimizer step; returns the batch's mean loss on every rank."""
        self._require_training("train_batch")  # before any stage starts: every rank refuses alike
        return self._pipeline_runner("train_batch").run(_iterator(data_iter, "train_batch"), loss_fn, train=True)

    def eval_batch(self, data_iter: Iterable[Any] | None = None,
                   loss_fn: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
        """The mean loss of one batch of micro-batches, forward only, no update."""
        return self._pipeline_runner("eval_batch").run(_iterator(data_iter, "eval_batch"), loss_fn, train=False)

    def is_first_stage(self) -> bool:
        return self.pipeline is None or self.pipeline.layout.first

    def is_last_stage(self) -> bool:
        return self.pipeline is None or self.pipeline.layout.last

    def pipeline_layout(self) -> StageLayout | None:
        """This rank's stage: the layer indices of each chunk (None without a pipeline)."""
        return None if self.pipeline is None else self.pipeline.layout

    def _pipeline_runner(self, call: str) -> PipelineRunner:
        self._require_alive(call)
        if self.pipeline is None:
            raise RuntimeError(f"engine.{call}() runs the pipeline schedule: set pipeline_parallel.size > 1, or "
                               "train with engine(batch), engine.backward(loss) and engine.step()")
        return self.pipeline


def _iterator(data_iter: Iterable[Any] | None, call: str):
    if data_iter is None:
        raise ValueError(f"engine.{call}(data_iter=...) needs an iterator of micro-batches (shardwise has no "
                         "training data loader of its own)")
    return iter(data_iter)
