"""`deepspeed.runtime`: the learning-rate schedules (`lr_schedules`), `utils`, the config's
error and names (`config`), the pipeline's module paths (`pipe`) and ZeRO's (`zero`)."""

from shardwise.frontends.deepspeed.api.runtime import config, lr_schedules, pipe, utils, zero

__all__ = ["config", "lr_schedules", "pipe", "utils", "zero"]
