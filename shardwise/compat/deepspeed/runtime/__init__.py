"""`deepspeed.runtime`: the learning-rate schedules (`lr_schedules`)."""

from shardwise.compat.deepspeed.runtime import lr_schedules

__all__ = ["lr_schedules"]
