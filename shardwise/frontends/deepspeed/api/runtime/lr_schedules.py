"""`deepspeed.runtime.lr_schedules`: DeepSpeed's warm-up schedules, shardwise's
implementation of them (shardwise/runtime/optim/schedulers.py), under DeepSpeed's names."""

from shardwise.runtime.optim.schedulers import WarmupCosineLR, WarmupDecayLR, WarmupLR

WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"

__all__ = ["WARMUP_COSINE_LR", "WARMUP_DECAY_LR", "WARMUP_LR", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR"]
