"""`deepspeed.runtime.config`: the config error scripts catch, and the optimizer-type names
DeepSpeed's config accepts (lower-cased, as DeepSpeed compares them).

`DeepSpeedConfigError` is shardwise's own config error (frontends/deepspeed/config/errors.py):
every config problem `deepspeed.initialize` finds is raised as it, listing each problem
with its key, so `except deepspeed.DeepSpeedConfigError` catches what it catches under
DeepSpeed (and DeepSpeed's other config exceptions, which shardwise reports the same way).
"""

from shardwise.frontends.deepspeed.config.errors import ConfigError as DeepSpeedConfigError

__all__ = ["ADAGRAD_OPTIMIZER", "ADAMW_OPTIMIZER", "ADAM_OPTIMIZER", "ADAM_W_MODE", "DEEPSPEED_OPTIMIZERS",
           "DeepSpeedConfigError", "LAMB_OPTIMIZER", "LION_OPTIMIZER", "ONEBIT_ADAM_OPTIMIZER",
           "ONEBIT_LAMB_OPTIMIZER", "TORCH_ADAM_PARAM", "ZERO_ONE_ADAM_OPTIMIZER"]

ADAGRAD_OPTIMIZER = "adagrad"
ADAM_OPTIMIZER = "adam"
ADAMW_OPTIMIZER = "adamw"
LAMB_OPTIMIZER = "lamb"
LION_OPTIMIZER = "lion"
ONEBIT_ADAM_OPTIMIZER = "onebitadam"
ZERO_ONE_ADAM_OPTIMIZER = "zerooneadam"
ONEBIT_LAMB_OPTIMIZER = "onebitlamb"
DEEPSPEED_OPTIMIZERS = [ADAGRAD_OPTIMIZER, ADAM_OPTIMIZER, ADAMW_OPTIMIZER, LAMB_OPTIMIZER, LION_OPTIMIZER,
                        ONEBIT_ADAM_OPTIMIZER, ZERO_ONE_ADAM_OPTIMIZER, ONEBIT_LAMB_OPTIMIZER]

TORCH_ADAM_PARAM = "torch_adam"  # optimizer.params key: torch's Adam instead of DeepSpeed's kernel
ADAM_W_MODE = "adam_w_mode"  # optimizer.params key: decoupled weight decay (True unless switched off)
