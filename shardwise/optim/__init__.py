"""Optimizers by config name (registry.py), how their state is checkpointed (codec.py),
shardwise's own optimizers (shard-aware: they also run on ZeRO's pieces of parameters), and
DeepSpeed's learning-rate schedules. Names are imported on first use, so the registry can
be read (for K, the state bytes per parameter) without importing torch."""

from typing import Any

__all__ = [
    "Adafactor",
    "Adam8bit",
    "AdamW8bit",
    "ElementwiseCodec",
    "Lamb",
    "Lars",
    "Muon",
    "OneBitAdam",
    "OneBitLamb",
    "OptimizerSpec",
    "StateCodec",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "build_optimizer",
    "build_scheduler",
    "optimizer_spec",
    "register_optimizer",
    "registered_optimizers",
]

_LAZY = {
    "Adafactor": "shardwise.optim.adafactor",
    "Adam8bit": "shardwise.optim.adam8bit",
    "AdamW8bit": "shardwise.optim.adam8bit",
    "Lamb": "shardwise.optim.lamb",
    "Lars": "shardwise.optim.lars",
    "Muon": "shardwise.optim.muon",
    "OneBitAdam": "shardwise.optim.onebit_adam",
    "OneBitLamb": "shardwise.optim.onebit_lamb",
    "build_optimizer": "shardwise.optim.build",
    "build_scheduler": "shardwise.optim.build",
    "ElementwiseCodec": "shardwise.optim.codec",
    "StateCodec": "shardwise.optim.codec",
    "OptimizerSpec": "shardwise.optim.registry",
    "optimizer_spec": "shardwise.optim.registry",
    "register_optimizer": "shardwise.optim.registry",
    "registered_optimizers": "shardwise.optim.registry",
    "WarmupCosineLR": "shardwise.optim.schedulers",
    "WarmupDecayLR": "shardwise.optim.schedulers",
    "WarmupLR": "shardwise.optim.schedulers",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'shardwise.optim' has no attribute {name!r}")
