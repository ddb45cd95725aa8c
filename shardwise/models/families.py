"""`parallelize`: a model's parallelisms by its family's plan, found by type (an explicit
list, no registration at import), or by a plan the user gives; models of no known family
get a plan that knows only what can be found in any model."""

from __future__ import annotations

from typing import Any

from torch import nn

from shardwise.models.core.plan import ModelPlan
from shardwise.models.core.steps import apply_plan
from shardwise.models.gpt import GPT
from shardwise.models.gpt import parallelize as gpt
from shardwise.models.hf import decoders, encoders, falcon, gpt2, llama, seq2seq
from shardwise.runtime.parallel.pipeline.sequential import SequentialAdapter, SequentialStages


def plan_for(model: nn.Module) -> ModelPlan:
    """The plan of `model`'s family. Any other model gets one with no model knowledge:
    recomputation and compilation find its repeated layers themselves, ZeRO needs nothing,
    and a tensor, sequence or pipeline split is refused, naming what to write."""
    if isinstance(model, GPT):
        return gpt.plan(model)
    if llama.is_llama_family(model):
        return llama.plan(model)
    if gpt2.is_gpt2(model):
        return gpt2.plan(model)
    # Gemma, Phi-3, Mixtral; Falcon; BERT, RoBERTa; T5; their look-alikes
    for detect in (decoders.detect, falcon.detect, encoders.detect, seq2seq.detect):
        detected = detect(model)
        if detected is not None:
            return detected
    if isinstance(model, SequentialStages):  # DeepSpeed's PipelineModule form: a list of layers
        return ModelPlan(name="SequentialStages", layers="layers", pipeline=SequentialAdapter())
    return ModelPlan(name=type(model).__name__)


def parallelize(model: nn.Module, *, plan: ModelPlan | None = None, **options: Any) -> nn.Module:
    """`model`'s parallelisms in the fixed order (core/steps.py `apply_plan`, whose keyword
    options `mesh`, `policies`, `tensor_styles`, `world` these are), by `plan` or its
    family's (`plan_for`)."""
    return apply_plan(model, plan or plan_for(model), **options)
