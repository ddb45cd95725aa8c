"""`deepspeed.runtime.utils`: the helpers scripts and model code import from it:
`set_random_seed`, the layer-partitioning functions pipeline code uses to assign layers
to stages (`partition_uniform`, `partition_balanced`, `prefix_sum_inc`), and
`see_memory_usage`."""

from __future__ import annotations

import logging
import random

import numpy as np
import torch

__all__ = ["partition_balanced", "partition_uniform", "prefix_sum_inc", "see_memory_usage", "set_random_seed"]

log = logging.getLogger("DeepSpeed")


def set_random_seed(seed: int) -> None:
    """Seed Python's, NumPy's and torch's generators (every device's)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def prefix_sum_inc(weights: list) -> list:
    """Inclusive prefix sums: [3, 4, 5] -> [3, 7, 12]."""
    sums, total = [], 0
    for weight in weights:
        total = total + weight
        sums.append(total)
    return sums


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """`num_parts + 1` boundaries cutting `num_items` items into parts whose sizes differ by
    at most one, the larger parts first; with fewer items than parts, one item per part
    and empty parts at the end."""
    if num_items <= num_parts:
        return [min(part, num_items) for part in range(num_parts + 1)]
    size, extra = divmod(num_items, num_parts)
    return [part * size + min(part, extra) for part in range(num_parts + 1)]


def partition_balanced(weights: list, num_parts: int) -> list[int]:
    """`num_parts + 1` boundaries cutting `weights` into contiguous, non-empty parts whose
    sums are as even as possible: the spread (largest part's sum minus smallest's) is
    minimised by dynamic programming over (items placed, parts used), each state keeping
    the spread, largest and smallest sum of its best split; among equal spreads the split
    with the later last cut wins, as in DeepSpeed. Fewer items than parts: `partition_uniform`."""
    count = len(weights)
    if count <= num_parts:
        return partition_uniform(count, num_parts)
    sums = [0.0] + [float(value) for value in prefix_sum_inc(weights)]
    inf = float("inf")
    # best[i][j] = (spread, largest, smallest, last cut) for the first i items in j parts
    best = [[(inf, inf, inf, 0)] * (num_parts + 1) for _ in range(count + 1)]
    best[0][0] = (0.0, -inf, inf, 0)
    for items in range(1, count + 1):
        for parts in range(1, min(items, num_parts) + 1):
            chosen = best[items][parts]
            for cut in range(parts - 1, items):
                spread_before, largest, smallest, _ = best[cut][parts - 1]
                if spread_before == inf:
                    continue
                last = sums[items] - sums[cut]
                high, low = max(largest, last), min(smallest, last)
                if high - low <= chosen[0]:
                    chosen = (high - low, high, low, cut)
            best[items][parts] = chosen
    bounds, items = [count], count
    for parts in range(num_parts, 0, -1):
        items = best[items][parts][3]
        bounds.append(items)
    return bounds[::-1]


def see_memory_usage(message: str, force: bool = False) -> None:
    """Log the accelerator's allocated and peak memory and the host's use, after `message`
    (only with `force=True`, as DeepSpeed: the calls stay in code and cost nothing)."""
    if not force:
        return
    device = ""
    if torch.cuda.is_available():
        gigabyte = 2**30
        device = (f" | device allocated {torch.cuda.memory_allocated() / gigabyte:.2f} GB, "
                  f"peak {torch.cuda.max_memory_allocated() / gigabyte:.2f} GB")
    with open("/proc/self/status") as status:
        resident = next((line.split()[1] for line in status if line.startswith("VmRSS:")), "0")
    log.info("%s%s | host resident %.2f GB", message, device, int(resident) / 2**20)
