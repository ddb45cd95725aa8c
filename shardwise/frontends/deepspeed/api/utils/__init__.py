"""`deepspeed.utils`: the `logger` and `log_dist` scripts use to print from some ranks,
`RepeatingLoader`, which pipeline scripts wrap their loaders in, and `zero_to_fp32`
(whole fp32 weights from a checkpoint, the functions scripts import from it)."""

from __future__ import annotations

import logging
import sys

import torch.distributed as dist

__all__ = ["RepeatingLoader", "log_dist", "logger"]


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


class RepeatingLoader:
    """Iterate `loader` forever, restarting it at its end (a pipeline's `train_batch` pulls
    micro-batches and must never meet the end of an epoch mid-batch)."""

    def __init__(self, loader):
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)
