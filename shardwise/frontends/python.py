"""The Python front end: an engine from policies, no config file (as FSDP2's
`fully_shard(model, mesh=..., mp_policy=...)` reads).

    engine = shardwise.build_engine(
        model,
        Policies(zero=ZeroPolicy(stage=3), precision=PrecisionPolicy(torch.bfloat16),
                 training=TrainingPolicy(micro_batch_size=8, gradient_clipping=1.0)),
        optimizer=torch.optim.AdamW(model.parameters(), lr=3e-4),
    )

It runs what every front end runs, in order: the checks that need nothing but the
arguments; the job (process group, ranks' agreement, mesh: runtime/engine/job.py); the
model's parallelisms (its family's plan, or `plan`: shardwise/models/); the engine,
whose ZeRO takes the parameters last.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
from torch import nn

from shardwise.models.families import parallelize
from shardwise.models.core.plan import ModelPlan
from shardwise.runtime.checkpoint.auto_resume import resume_latest
from shardwise.runtime.distributed.setup import DistributedContext
from shardwise.runtime.engine import Engine, Policies, start_job
from shardwise.runtime.engine.arguments import check_arguments, refuse_second_engine


def build_engine(
    model: nn.Module,
    policies: Policies = Policies(),
    *,
    optimizer: torch.optim.Optimizer | None = None,
    lr_scheduler: Any = None,
    param_init_fn: Callable[[nn.Module], None] | None = None,
    plan: ModelPlan | None = None,
    tensor_styles: Mapping[str, str] | None = None,
    context: DistributedContext | None = None,
    settings: Mapping[str, Any] | None = None,
    engine_class: Callable[..., Engine] = Engine,
) -> Engine:
    """Train `model` by `policies`. `optimizer`: a torch optimizer over its parameters
    (kept, re-pointed at the partitions), or `policies.optimizer`, or neither (forward
    only). `plan`: what shardwise needs to know about a model of no built-in family;
    `tensor_styles` replace a family's tensor-parallel styles. `param_init_fn(module)`
    materialises a model built on the meta device (ZeRO-3). `settings`: the policies as the
    user wrote them (a front end's config), so that ranks that differ are told by its keys."""
    refuse_second_engine(model)  # before anything rewrites the model another engine trains
    check_arguments(policies, optimizer, lr_scheduler)
    job = start_job(model, policies, optimizer, context, settings)
    model = parallelize(model, mesh=job.mesh, policies=policies, plan=plan, tensor_styles=tensor_styles,
                        world=job.world)
    engine = engine_class(model, job=job, policies=policies, optimizer=optimizer, lr_scheduler=lr_scheduler,
                          param_init_fn=param_init_fn)
    if policies.checkpoint.resume_from is not None and engine.trains:  # an elastic restart goes on from there
        engine.resumed_client_state = resume_latest(
            engine, policies.checkpoint.resume_from, lambda folder, tag: Engine.load_checkpoint(engine, folder, tag))
    return engine
