"""`deepspeed.utils.logging`: DeepSpeed's "DeepSpeed" logger (to stdout, with DeepSpeed's
line format) and `log_dist`, which logs from chosen ranks."""

from __future__ import annotations

import logging
import sys

import torch.distributed as dist

__all__ = ["log_dist", "logger"]


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
