"""`deepspeed.runtime.dataloader`: DeepSpeed's loader of the training data, whose position
the engine's checkpoints hold (frontends/deepspeed/data_loader.py), and `RepeatingLoader`."""

from shardwise.frontends.deepspeed.api.utils.repeating_loader import RepeatingLoader
from shardwise.frontends.deepspeed.data_loader import DeepSpeedDataLoader, PositionedSampler

__all__ = ["DeepSpeedDataLoader", "PositionedSampler", "RepeatingLoader"]
