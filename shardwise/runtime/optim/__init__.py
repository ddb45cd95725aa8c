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
    "optimizer_spec",
    "register_optimizer",
    "registered_optimizers",
]

_LAZY = {
    "Adafactor": "shardwise.runtime.optim.adafactor",
    "Adam8bit": "shardwise.runtime.optim.adam8bit",
    "AdamW8bit": "shardwise.runtime.optim.adam8bit",
    "Lamb": "shardwise.runtime.optim.lamb",
    "Lars": "shardwise.runtime.optim.lars",
    "Muon": "shardwise.runtime.optim.muon",
    "OneBitAdam": "shardwise.runtime.optim.onebit_adam",
    "OneBitLamb": "shardwise.runtime.optim.onebit_lamb",
    "ElementwiseCodec": "shardwise.runtime.optim.codec",
    "StateCodec": "shardwise.runtime.optim.codec",
    "OptimizerSpec": "shardwise.runtime.optim.registry",
    "optimizer_spec": "shardwise.runtime.optim.registry",
    "register_optimizer": "shardwise.runtime.optim.registry",
    "registered_optimizers": "shardwise.runtime.optim.registry",
    "WarmupCosineLR": "shardwise.runtime.optim.schedulers",
    "WarmupDecayLR": "shardwise.runtime.optim.schedulers",
    "WarmupLR": "shardwise.runtime.optim.schedulers",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'shardwise.runtime.optim' has no attribute {name!r}")
