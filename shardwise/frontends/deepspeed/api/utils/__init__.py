"""`deepspeed.utils`: the `logger` and `log_dist` scripts use to print from some ranks,
`RepeatingLoader`, which pipeline scripts wrap their loaders in, `zero_to_fp32` (whole
fp32 weights from a checkpoint, the functions scripts import from it), the `safe_*`
helpers that read and write a parameter's training state under ZeRO (tensor_fragment.py),
and the ZeRO-3 leaf-module flags MoE scripts set (z3_leaf_module.py)."""

from __future__ import annotations

import logging
import sys

import torch.distributed as dist

from shardwise.frontends.deepspeed.api.runtime.dataloader import RepeatingLoader
from shardwise.frontends.deepspeed.api.utils.tensor_fragment import (
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
    "RepeatingLoader", "log_dist", "logger", "safe_get_full_fp32_param", "safe_get_full_grad",
    "safe_get_full_optimizer_state", "safe_get_local_fp32_param", "safe_get_local_grad",
    "safe_get_local_optimizer_state", "safe_set_full_fp32_param", "safe_set_full_grad",
    "safe_set_full_optimizer_state", "safe_set_local_fp32_param", "safe_set_local_grad",
    "safe_set_local_optimizer_state", "safe_update_full_grad_vectorized", "get_z3_leaf_modules", "set_z3_leaf_module",
    "set_z3_leaf_modules", "set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix", "unset_z3_leaf_modules",
    "z3_leaf_module", "z3_leaf_parameter",
]


def _make_logger() -> logging.Logger:
    named = logging.getLogger("DeepSpeed")
    if not named.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:%(funcName)s] "
                                               "%(message)s"))
        named.addHandler(handler)
        named.setLevel(logging.INFO)
        named.propagate = False
    return named


logger = _make_logger()


def log_dist(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    """Log `message` on the listed ranks (all of them when the list holds -1), prefixed
    with the rank; without a process group, always, as DeepSpeed does."""
    if not dist.is_initialized():
        logger.log(level, message)
        return
    rank = dist.get_rank()
    if ranks and (ranks[0] == -1 or rank in set(ranks)):
        logger.log(level, f"[Rank {rank}] {message}")
