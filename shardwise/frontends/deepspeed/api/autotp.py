"""`deepspeed.tp_model_init` and `deepspeed.set_autotp_mode`: DeepSpeed 0.19.8's AutoTP entry
points for training, which the Hugging Face Trainer calls when the config sets
`tensor_parallel.autotp_size` > 1 (transformers' `deepspeed_init`).

In DeepSpeed 0.19.8 `tp_model_init` only records its arguments and returns the model
unchanged; `deepspeed.initialize` splits the model, with the config as the canonical
source and a mismatch an error. shardwise does the same: the model's family plan splits
it at `initialize` (`tensor_parallel.autotp_size` becomes `tensor_parallel.size`), and
`initialize` refuses a recorded size the config does not have (`check_recorded_size`).
A `tp_group` is refused, as `initialize(mpu=...)` is: shardwise builds the
tensor-parallel group from the config.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["check_recorded_size", "set_autotp_mode", "tp_model_init"]

_RECORDED = "_deepspeed_tp_model_init"  # the model's attribute holding tp_model_init's tp_size


def tp_model_init(model: nn.Module, tp_size: int, dtype: torch.dtype, config: Any = None, **kwargs: Any) -> nn.Module:
    """Record `tp_size` for `initialize` and return `model` as it is (DeepSpeed 0.19.8's
    contract); `dtype` is the config's precision there too."""
    if kwargs.get("tp_group") is not None:
        raise ValueError("deepspeed.tp_model_init(tp_group=...) is not supported: shardwise builds the "
                         "tensor-parallel group from the config; set tensor_parallel.autotp_size instead")
    if isinstance(config, dict):
        written = (config.get("tensor_parallel") or {}).get("autotp_size")
        if written is not None and written != "auto" and int(written) != tp_size:
            raise ValueError(f"deepspeed.tp_model_init(tp_size={tp_size}) and the config's tensor_parallel.autotp_size "
                             f"{written} differ: give one size (the config's is used)")
    setattr(model, _RECORDED, int(tp_size))
    return model


def check_recorded_size(model: nn.Module, tensor_size: int) -> None:
    """At `initialize`: the config must split the model as `tp_model_init` recorded."""
    recorded = getattr(model, _RECORDED, None)
    if recorded is not None and recorded != tensor_size:
        raise ValueError(f"deepspeed.tp_model_init recorded tp_size {recorded}, but the config splits the model over "
                         f"{tensor_size} rank(s): set tensor_parallel.autotp_size to {recorded} (DeepSpeed 0.19.8 "
                         "takes the size from the config and refuses a mismatch)")


def set_autotp_mode(training: bool = False) -> None:
    """DeepSpeed switches its AutoTP layers between training and inference kernels here;
    shardwise's tensor-parallel layers serve both, so there is nothing to switch."""
