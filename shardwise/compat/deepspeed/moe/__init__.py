"""`deepspeed.moe`: what scripts import from it without using experts (`moe.utils`)."""

from shardwise.compat.deepspeed.moe import utils

__all__ = ["utils"]
