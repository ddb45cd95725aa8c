"""`apply_tensor_parallel`: the first step of a model's `parallelize` (shardwise/models/).

It rewrites the model in place, before ZeRO sees it:

1. every parameter is made identical across the tensor group (broadcast from its first
   rank), so the shards cut next come from one model and parameters that stay replicated
   start equal;
2. each module a plan entry names gets its style (styles.py); a parameter tied between
   two modules becomes one local parameter;
3. a Hugging Face model's `loss_function` becomes the vocabulary-parallel causal-LM loss,
   so `model(input_ids, labels=labels).loss` stays right.

Megatron sequence parallelism, which runs the decoder stack on 1/N of the sequence inside
the tensor group, is the next step (parallel/sequence/megatron.py).

Replicated parameters stay identical afterwards without further communication: their
gradients are equal on every tensor rank (the backward all-reduces make them so, or, with
sequence parallelism, an explicit all-reduce), the gradient norm is agreed over the tensor
group (tensor_norm.py), and the optimizer is deterministic.
"""

from __future__ import annotations

from torch import nn

from shardwise.runtime.distributed.collectives import Communicator
from shardwise.runtime.distributed.staging import staged_on
from shardwise.runtime.parallel.tensor.cross_entropy import causal_lm_loss
from shardwise.runtime.parallel.tensor.layers import ShardCache, TensorRegion
from shardwise.runtime.parallel.tensor.plans import TensorPlan, check_divisible, matches
from shardwise.runtime.parallel.tensor.styles import style


def broadcast_parameters(model: nn.Module, comm: Communicator) -> None:
    """Make every (materialised) parameter equal to the tensor group's first rank's.

    the engine moves the model to its device after the parallelize steps, so that the full
    model never sits on one device; over an NCCL group each weight still in host memory
    goes through the device one at a time (distributed/staging.py)."""
    device = comm.staging_device
    for name, param in model.named_parameters():
        if not param.is_meta:
            with staged_on(param.data, device) as data:
                comm.broadcast(data, 0, f"parameter {name} before tensor-parallel sharding")


def apply_tensor_parallel(model: nn.Module, region: TensorRegion, plan: TensorPlan,
                          key: str = "tensor_parallel.plan") -> nn.Module:
    """Split `model` over `region`'s tensor group by `plan`; returns the same model,
    rewritten. `key` names where the plan came from, for errors."""
    check_divisible(plan, region.size, "tensor_parallel.size")
    broadcast_parameters(model, region.comm)
    _apply_styles(model, plan, region, key)
    if plan.hf_loss and hasattr(model, "loss_function"):
        model.loss_function = causal_lm_loss
    return model


def _apply_styles(model: nn.Module, plan: TensorPlan, region: TensorRegion, key: str) -> None:
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
