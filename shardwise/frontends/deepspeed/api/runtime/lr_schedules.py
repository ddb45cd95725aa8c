"""`deepspeed.runtime.lr_schedules`: DeepSpeed's learning-rate schedules, shardwise's
implementation of them (shardwise/runtime/optim/schedulers.py), under DeepSpeed's names."""

from shardwise.runtime.optim.schedulers import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR

LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]

__all__ = ["LRRangeTest", "LR_RANGE_TEST", "ONE_CYCLE", "OneCycle", "VALID_LR_SCHEDULES", "WARMUP_COSINE_LR",
           "WARMUP_DECAY_LR", "WARMUP_LR", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR"]
