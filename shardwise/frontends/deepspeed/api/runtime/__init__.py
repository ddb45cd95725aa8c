"""`deepspeed.runtime`: the learning-rate schedules (`lr_schedules`), `utils`, the classes of
DeepSpeed's optimizer wrappers (`base_optimizer`), the config's error and names
(`config`), the loss scalers (`fp16`), the pipeline's module paths (`pipe`), ZeRO's
(`zero`), the data efficiency library's schedules (`data_pipeline`) and the training
data's loader (`dataloader`); the engines' modules (`engine`, `pipe.engine`) are imported
when named."""

from shardwise.frontends.deepspeed.api.runtime import (base_optimizer, config, data_pipeline, dataloader, fp16,
                                                       lr_schedules, pipe, utils, zero)

__all__ = ["base_optimizer", "config", "data_pipeline", "dataloader", "fp16", "lr_schedules", "pipe", "utils", "zero"]
