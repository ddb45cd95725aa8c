"""`deepspeed.runtime`: the learning-rate schedules (`lr_schedules`), `utils`, the config's
error and names (`config`), and ZeRO's module paths (`zero`)."""

from shardwise.frontends.deepspeed.api.runtime import config, lr_schedules, utils, zero

__all__ = ["config", "lr_schedules", "utils", "zero"]
