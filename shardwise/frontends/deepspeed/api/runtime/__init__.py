"""`deepspeed.runtime`: the learning-rate schedules (`lr_schedules`), `utils`, the config's
error and names (`config`), the pipeline's module paths (`pipe`), ZeRO's (`zero`) and the
data efficiency library's schedules (`data_pipeline`)."""

from shardwise.frontends.deepspeed.api.runtime import config, data_pipeline, lr_schedules, pipe, utils, zero

__all__ = ["config", "data_pipeline", "lr_schedules", "pipe", "utils", "zero"]
