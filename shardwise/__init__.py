"""shardwise: ZeRO-style memory-efficient training for PyTorch, small enough to read.

    engine = shardwise.initialize(model, "ds_config.json", optimizer=...)   # a DeepSpeed config
    engine = shardwise.build_engine(model, shardwise.Policies(...), optimizer=...)  # or policies

The public names are imported on first use, so command-line tools that need no torch
(`shardwise estimate`, `--help`) start instantly.
"""

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "initialize": "shardwise.frontends.deepspeed.initialize",
    "build_engine": "shardwise.frontends.python",
    "Engine": "shardwise.runtime.engine",
    "gathered_parameters": "shardwise.runtime.zero.gathered",
    "ModelPlan": "shardwise.models.core.plan",
    "parallelize": "shardwise.models.families",
    "Policies": "shardwise.runtime.engine.policies",
    "TrainingPolicy": "shardwise.runtime.engine.policies",
    "OptimizerPolicy": "shardwise.runtime.engine.policies",
    "SchedulerPolicy": "shardwise.runtime.engine.policies",
    "ZeroPolicy": "shardwise.runtime.zero.policy",
    "OffloadPolicy": "shardwise.runtime.zero.policy",
    "PrefetchPolicy": "shardwise.runtime.zero.policy",
    "PrecisionPolicy": "shardwise.runtime.precision.policy",
    "LossScalingPolicy": "shardwise.runtime.precision.policy",
    "TensorPolicy": "shardwise.runtime.parallel.tensor.policy",
    "SequencePolicy": "shardwise.runtime.parallel.sequence.policy",
    "PipelinePolicy": "shardwise.runtime.parallel.pipeline.policy",
    "ActivationPolicy": "shardwise.runtime.activation.policy",
    "RecomputePolicy": "shardwise.runtime.activation.policy",
    "CompilePolicy": "shardwise.runtime.compile.policy",
    "KernelPolicy": "shardwise.runtime.ops.policy",
    "ShardwiseTrainer": "shardwise.frontends.hf_trainer.trainer",
}
__all__ = [*_LAZY, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'shardwise' has no attribute {name!r}")
