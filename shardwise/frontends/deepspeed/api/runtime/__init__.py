"""`deepspeed.runtime`: the learning-rate schedules (`lr_schedules`), `utils.set_random_seed`
and the data efficiency library's curriculum schedule (`data_pipeline`)."""

from shardwise.frontends.deepspeed.api.runtime import data_pipeline, lr_schedules, utils

__all__ = ["data_pipeline", "lr_schedules", "utils"]
