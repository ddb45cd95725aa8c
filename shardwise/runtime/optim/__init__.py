"""Optimizers by config name (registry.py), how their state is checkpointed (codec.py),
shardwise's own optimizers (shard-aware: they also run on ZeRO's pieces of parameters), and
DeepSpeed's learning-rate schedules.

The built-in optimizers are imported here, so that each registers itself, in the order
the config reference lists them; their classes are re-exported. An optimizer added to
this folder is added to this list, and nowhere else (docs/optimizers.md#adding-an-optimizer).
"""

from shardwise.runtime.optim import torch_optimizers  # noqa: F401  (Adam, AdamW, SGD, Adagrad)
from shardwise.runtime.optim.lamb import Lamb
from shardwise.runtime.optim.lars import Lars
from shardwise.runtime.optim.lion import Lion
from shardwise.runtime.optim.adafactor import Adafactor
from shardwise.runtime.optim.adam8bit import Adam8bit, AdamW8bit
from shardwise.runtime.optim.muon import Muon
from shardwise.runtime.optim.onebit_adam import OneBitAdam
from shardwise.runtime.optim.onebit_lamb import OneBitLamb
from shardwise.runtime.optim.zero_one_adam import ZeroOneAdam

from shardwise.runtime.optim.codec import ElementwiseCodec, StateCodec
from shardwise.runtime.optim.registry import (OptimizerSpec, optimizer_spec, optimizer_specs, register_optimizer,
                                              registered_optimizers)
from shardwise.runtime.optim.schedulers import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR

__all__ = [
    "Adafactor",
    "Adam8bit",
    "AdamW8bit",
    "ElementwiseCodec",
    "LRRangeTest",
    "Lamb",
    "Lars",
    "Lion",
    "Muon",
    "OneBitAdam",
    "OneBitLamb",
    "OneCycle",
    "OptimizerSpec",
    "StateCodec",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "ZeroOneAdam",
    "optimizer_spec",
    "optimizer_specs",
    "register_optimizer",
    "registered_optimizers",
]
