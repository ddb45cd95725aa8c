"""The apply stage: model rewrites that must happen before ZeRO captures parameter identity.

`initialize()` transforms the model in one fixed order, the one torchtitan uses:

    tensor parallel -> sequence parallel -> activation checkpointing -> compile
        -> pipeline split -> ZeRO

Tensor parallelism replaces weights with their local shards, so it comes first; sequence
parallelism changes where activations are split inside those layers; checkpointing wraps
the (now parallel) blocks; compilation sees the final blocks; the pipeline split decides
which blocks this rank keeps; ZeRO (shardwise/runtime/zero/apply.py) then partitions whatever
parameters remain. Each capability is a function in its own module, registered here
under its slot, and can also be called directly on a model; the engine only calls
`apply_model_transforms`. A step that is not enabled by the config is skipped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn

from shardwise.frontends.deepspeed.config import ShardwiseConfig
from shardwise.runtime.distributed.mesh import ParallelMesh

ORDER = ("tensor_parallel", "sequence_parallel", "activation_checkpointing", "compile", "pipeline")


@dataclass(frozen=True)
class ModelTransform:
    """One slot of the apply stage: when it applies, and the function that applies it."""

    name: str
    enabled: Callable[[ShardwiseConfig], bool]
    apply: Callable[[nn.Module, ShardwiseConfig, ParallelMesh], nn.Module]


_TRANSFORMS: dict[str, ModelTransform] = {}


def register_transform(transform: ModelTransform) -> None:
    """Give a capability its slot; the order of application is ORDER, not registration."""
    if transform.name not in ORDER:
        raise ValueError(f"unknown apply step {transform.name!r}; the steps are, in order: {', '.join(ORDER)}")
    if transform.name in _TRANSFORMS:
        raise ValueError(f"apply step {transform.name!r} is registered twice")
    _TRANSFORMS[transform.name] = transform


def unregister_transform(name: str) -> None:
    _TRANSFORMS.pop(name, None)


def apply_model_transforms(model: nn.Module, config: ShardwiseConfig, mesh: ParallelMesh) -> nn.Module:
    """Every enabled transformation, in ORDER; returns the model ZeRO will partition."""
    for name in ORDER:
        transform = _TRANSFORMS.get(name)
        if transform is not None and transform.enabled(config):
            model = transform.apply(model, config, mesh)
    return model
