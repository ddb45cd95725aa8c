from shardwise.optim.build import build_optimizer, build_scheduler
from shardwise.optim.schedulers import WarmupCosineLR, WarmupDecayLR, WarmupLR

__all__ = ["build_optimizer", "build_scheduler", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
