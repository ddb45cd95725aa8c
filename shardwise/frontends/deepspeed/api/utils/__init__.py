"""`deepspeed.utils`: the `logger` and `log_dist` scripts use to print from some ranks (also
as `deepspeed.utils.logging.logger`, whose level Lightning sets),
`RepeatingLoader`, which pipeline scripts wrap their loaders in, `zero_to_fp32` (whole
fp32 weights from a checkpoint, the functions scripts import from it), the `safe_*`
helpers that read and write a parameter's training state under ZeRO (tensor_fragment.py),
the ZeRO-3 leaf-module flags MoE scripts set (z3_leaf_module.py), `groups`, the
data/model/sequence/expert-parallel group getters (groups.py), and `OnDevice`, which builds
a model's tensors on a device in a dtype (init_on_device.py)."""

from __future__ import annotations

from shardwise.frontends.deepspeed.api.utils.exceptions import DeprecatedException
from shardwise.frontends.deepspeed.api.utils.init_on_device import OnDevice
from shardwise.frontends.deepspeed.api.utils.repeating_loader import RepeatingLoader
from shardwise.frontends.deepspeed.api.utils import groups, logging
from shardwise.frontends.deepspeed.api.utils.logging import log_dist, logger
from shardwise.frontends.deepspeed.api.utils.tensor_fragment import (
    fragment_address,
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_get_local_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_grad,
    safe_set_full_optimizer_state,
    safe_set_local_fp32_param,
    safe_set_local_grad,
    safe_set_local_optimizer_state,
    safe_update_full_grad_vectorized,
)
from shardwise.frontends.deepspeed.api.utils.z3_leaf_module import (
    get_z3_leaf_modules,
    set_z3_leaf_module,
    set_z3_leaf_modules,
    set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix,
    unset_z3_leaf_modules,
    z3_leaf_module,
    z3_leaf_parameter,
)

__all__ = [
    "DeprecatedException", "OnDevice", "RepeatingLoader", "fragment_address", "groups", "log_dist", "logger",
    "logging", "safe_get_full_fp32_param", "safe_get_full_grad",
    "safe_get_full_optimizer_state", "safe_get_local_fp32_param", "safe_get_local_grad",
    "safe_get_local_optimizer_state", "safe_set_full_fp32_param", "safe_set_full_grad",
    "safe_set_full_optimizer_state", "safe_set_local_fp32_param", "safe_set_local_grad",
    "safe_set_local_optimizer_state", "safe_update_full_grad_vectorized", "get_z3_leaf_modules", "set_z3_leaf_module",
    "set_z3_leaf_modules", "set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix", "unset_z3_leaf_modules",
    "z3_leaf_module", "z3_leaf_parameter",
]
