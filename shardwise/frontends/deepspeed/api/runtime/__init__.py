"""`deepspeed.runtime`: the learning-rate schedules (`lr_schedules`) and `utils.set_random_seed`."""

from shardwise.frontends.deepspeed.api.runtime import lr_schedules, utils

__all__ = ["lr_schedules", "utils"]
