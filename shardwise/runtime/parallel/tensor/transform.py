"""`apply_tensor_parallel`: the apply stage's "tensor_parallel" step.

It rewrites the model in place, before ZeRO sees it:

1. every parameter is made identical across the tensor group (broadcast from its first
   rank), so the shards cut next come from one model and parameters that stay replicated
   start equal;
2. each module a plan entry names gets its style (styles.py); a parameter tied between
   two modules becomes one local parameter;
3. a Hugging Face model's `loss_function` becomes the vocabulary-parallel causal-LM loss,
   so `model(input_ids, labels=labels).loss` stays right;
4. with Megatron sequence parallelism, the decoder stack runs on 1/N of the sequence
   (parallel/sequence/megatron.py).

Replicated parameters stay identical afterwards without further communication: their
gradients are equal on every tensor rank (the backward all-reduces make them so, or, with
sequence parallelism, an explicit all-reduce), the gradient norm is agreed over the tensor
group (tensor_norm.py), and the optimizer is deterministic.
"""

from __future__ import annotations

from typing import Mapping

from torch import nn

from shardwise.frontends.deepspeed.config import ShardwiseConfig
from shardwise.runtime.distributed.collectives import CommStats, Communicator
from shardwise.runtime.distributed.mesh import ParallelMesh
from shardwise.runtime.distributed.staging import group_device, staged_on
from shardwise.runtime.apply import ModelTransform, register_transform
from shardwise.runtime.parallel.tensor.cross_entropy import causal_lm_loss
from shardwise.runtime.parallel.tensor.layers import ShardCache, TensorRegion
from shardwise.runtime.parallel.tensor.plans import ModelPlan, check_divisible, matches, require_plan
from shardwise.runtime.parallel.tensor.styles import style


def mesh_communicator(mesh: ParallelMesh, purpose: str) -> Communicator:
    """A communicator over one of the mesh's groups, counting into the engine's statistics
    when the engine provided them (`mesh.comm_stats`), so `comm_volume()` shows its bytes."""
    return Communicator(mesh[purpose], getattr(mesh, "comm_stats", None) or CommStats())


def megatron_sequence_parallel(config: ShardwiseConfig) -> bool:
    return config.tensor_parallel.sequence_parallel or config.sequence_parallel.mode == "megatron"


def broadcast_parameters(model: nn.Module, comm: Communicator) -> None:
    """Make every (materialised) parameter equal to the tensor group's first rank's.

    `initialize` moves the model to its device after the apply stage, so that the full
    model never sits on one device; over an NCCL group each weight still in host memory
    goes through the device one at a time (distributed/staging.py)."""
    device = group_device(comm.group)
    for name, param in model.named_parameters():
        if not param.is_meta:
            with staged_on(param.data, device) as data:
                comm.broadcast(data, 0, f"parameter {name} before tensor-parallel sharding")


def apply_tensor_parallel(
    model: nn.Module, region: TensorRegion, plan: Mapping[str, str] | None = None,
    key: str = "tensor_parallel.plan",
) -> nn.Module:
    """Split `model` over `region`'s tensor group by `plan` (module-name pattern -> style)
    or its architecture's built-in plan; returns the same model, rewritten."""
    model_plan = require_plan(model, plan, key)
    check_divisible(model_plan, region.size, "tensor_parallel.size")
    broadcast_parameters(model, region.comm)
    _apply_styles(model, model_plan, region, key)
    if model_plan.hf_loss and hasattr(model, "loss_function"):
        model.loss_function = causal_lm_loss
    if region.sequence_parallel:
        from shardwise.runtime.parallel.sequence.megatron import apply_megatron_sequence_parallel

        apply_megatron_sequence_parallel(model, model_plan, region)
    return model


def _apply_styles(model: nn.Module, plan: ModelPlan, region: TensorRegion, key: str) -> None:
    cache = ShardCache()
    used = dict.fromkeys(plan.styles, False)
    for name, module in list(model.named_modules()):
        entries = [pattern for pattern in plan.styles if name and matches(pattern, name)]
        if not entries:
            continue
        if len(entries) > 1:
            raise ValueError(f"{key}: module {name} matches several entries ({', '.join(entries)}); keep one")
        pattern = entries[0]
        used[pattern] = True
        replacement = style(plan.styles[pattern], f"{key}[{pattern!r}]")(module, region, cache)
        if replacement is not module:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, replacement)
    unused = [pattern for pattern, hit in used.items() if not hit]
    if unused:
        raise ValueError(f"{key}: no module of {type(model).__name__} matches {', '.join(map(repr, unused))}")


def _transform(model: nn.Module, config: ShardwiseConfig, mesh: ParallelMesh) -> nn.Module:
    region = TensorRegion(mesh_communicator(mesh, "tensor"), megatron_sequence_parallel(config))
    return apply_tensor_parallel(model, region, config.tensor_parallel.plan)


register_transform(ModelTransform("tensor_parallel", lambda config: config.tensor_parallel.size > 1, _transform))

